/** What a GPU is (its memory, a MIG slice) and what a queued request waits for (a GPU type, a memory size). */

import { formatBytes } from './format';

/** '80 GiB' or '10 GiB · MIG slice': shown on each GPU card under its name (which carries the model). */
export function gpuKind(g: { memory_total: number; mig?: boolean }): string {
  return `${formatBytes(g.memory_total)}${g.mig ? ' · MIG slice' : ''}`;
}

/** ', H100, ≥ 40 GiB each' for a request that names a GPU type or size; '' for any GPU. */
export function wants(e: { gpu_type?: string; gpu_mem?: number }): string {
  const parts = [e.gpu_type ? e.gpu_type : '', e.gpu_mem ? `≥ ${formatBytes(e.gpu_mem)} each` : ''].filter(Boolean);
  return parts.length ? `, ${parts.join(', ')}` : '';
}
