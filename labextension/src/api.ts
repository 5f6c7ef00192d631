import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IDevice, ILease, IWait } from './leaseView';

/** An error answer of the server extension or the broker: `{status, reason, message}`. */
export class GpuLeaseError extends Error {
  constructor(
    readonly status: number,
    readonly reason: string,
    message: string
  ) {
    super(message);
  }
}

/** Call `{base_url}/gpulease/api/<path>` with Jupyter's authentication. */
export async function requestAPI<T>(
  path: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, 'gpulease', 'api', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new GpuLeaseError(0, 'network', `Jupyter server unreachable: ${error}`);
  }
  const text = await response.text();
  let data: { reason?: string; message?: string } = {};
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = { message: text.slice(0, 300) };
    }
  }
  if (!response.ok) {
    throw new GpuLeaseError(
      response.status,
      data.reason ?? 'error',
      data.message ?? `HTTP ${response.status}`
    );
  }
  return data as unknown as T;
}

/** The websocket URL of the event relay, with the token when the server expects it in the URL. */
export function eventsURL(
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): string {
  let url = URLExt.join(settings.wsUrl, 'gpulease', 'events');
  if (settings.appendToken && settings.token) {
    url += `?token=${encodeURIComponent(settings.token)}`;
  }
  return url;
}

export interface IHolder {
  user: string;
  lease_id: string | null;
  fraction: number;
  expires_at: number | null;
  mine: boolean;
}

/** A GPU as `GET /gpus` shows it: the device a lease's view lists, with its figures, state and holders. */
export interface IGpu extends IDevice {
  memory_used: number;
  utilization: number;
  state: string;
  simulated: boolean;
  holders: IHolder[];
  /** While state is 'reserved': the open advance reservation the GPU is held for. */
  reservation?: { id: string; user: string; group: string; end: number };
}

export interface ISummary {
  total: number;
  free: number;
  states: Record<string, number>;
  queued: number;
  simulated: boolean;
}

export interface IInfo {
  simulated: boolean;
  time: number;
  user: { name: string; uid: number | null; admin: boolean };
  summary: ISummary;
  inventory?: unknown;
}

export interface IQueueEntry {
  position: number;
  lease_id: string | null;
  user: string;
  mine: boolean;
  min_gpus: number;
  max_gpus: number;
  fraction: number;
  /** What it waits for: a GPU type ('' = any) and memory per GPU in bytes (0 = any). */
  gpu_type?: string;
  gpu_mem?: number;
  waited_seconds: number;
  estimated_start: number | null;
  estimated_start_range?: [number, number] | null;
  /** The broker's words for the start estimate ("in 1–3 min", "unknown"). */
  estimate_text?: string | null;
  /** Why it waits, in the broker's words. */
  wait?: IWait | null;
}

export interface IArtifact {
  lease_id: string;
  path: string;
  relative_path: string | null;
  modified: number;
  meta: Record<string, unknown> | null;
  files: string[];
}

/** One GPU in a `gpu_samples` event: what it does at an inventory sample. */
export interface IGpuSample {
  id: string;
  /** Percent. */
  utilization: number;
  /** Bytes. */
  memory_used: number;
}

/** A broker event as the relay sends it: its type and the fields the sidebar reads (each type carries some). */
export interface IEvent {
  schema: string;
  type: string;
  /** `lease` events: the lease's view after the change, the change and the state before it. */
  lease?: ILease;
  change?: string;
  previous?: string | null;
  /** The user the event is about (leases and warnings). */
  user?: string | null;
  /** Warnings and preemptions: the lease, when it happens, the warning's kind and words, the preempting class. */
  lease_id?: string;
  deadline?: number;
  kind?: string;
  message?: string;
  by_class?: string;
  /** `gpu_samples`: broker time and each GPU's figures. */
  time?: number;
  gpus?: IGpuSample[];
}
