/** The last minutes of each GPU's utilisation and memory use, from the broker's `gpu_samples` events. */

import { IGpu, IGpuSample } from './api';

/** How far back the GPU charts reach, in seconds. */
export const HISTORY_SECONDS = 300;

/** One sample of one GPU: broker time, utilisation (percent, as the broker reports it) and memory used (0..1 of
 * its total). */
export interface IPoint {
  t: number;
  util: number;
  mem: number;
}

export class SampleHistory {
  constructor(readonly seconds: number = HISTORY_SECONDS) {}

  points(gpuId: string): IPoint[] {
    return this._points.get(gpuId) ?? [];
  }

  /** Add one sample of the GPUs in it, taken at broker time `t`. */
  add(t: number, samples: IGpuSample[], gpus: IGpu[]): void {
    const totals = new Map(gpus.map(g => [g.id, g.memory_total]));
    for (const s of samples) {
      const total = totals.get(s.id);
      if (total === undefined) {
        continue; // a GPU the sidebar does not show (yet)
      }
      const pts = this._points.get(s.id) ?? [];
      pts.push({ t, util: s.utilization, mem: total ? s.memory_used / total : 0 });
      while (pts.length && pts[0].t < t - this.seconds) {
        pts.shift();
      }
      this._points.set(s.id, pts);
    }
  }

  /** Start the chart of a GPU that has none yet from a fetched snapshot (before the first sample event). */
  seed(t: number, gpus: IGpu[]): void {
    const fresh = gpus.filter(g => !this._points.get(g.id)?.length);
    this.add(
      t,
      fresh.map(g => ({ id: g.id, utilization: g.utilization, memory_used: g.memory_used })),
      fresh
    );
  }

  private _points = new Map<string, IPoint[]>();
}
