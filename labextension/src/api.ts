import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

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
  let data: any = {};
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
  return data as T;
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

export interface IGpu {
  id: string;
  index: number;
  node: string;
  name: string;
  memory_total: number;
  memory_used: number;
  utilization: number;
  state: string;
  simulated: boolean;
  /** A MIG device (a slice of a GPU in MIG mode); its name ends with the profile. */
  mig?: boolean;
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

export interface ILease {
  id: string;
  user: string;
  state: string;
  reason: string | null;
  created_at: number;
  granted_at: number | null;
  expires_at: number | null;
  devices: { id: string; index: number; node: string; name: string }[];
  duration_seconds: number;
  idle_timeout_seconds: number;
  idle_deadline: number | null;
  /** The latest end a renewal may reach under the policy (holding leases). */
  max_expires_at?: number | null;
  /** Processes attached to the lease (a %%gpu cell's worker while it runs). */
  pids: number[];
  position: number | null;
  /** A queued lease's likely start (epoch seconds), and [low, high] when the broker says how unsure it is. */
  estimated_start: number | null;
  estimated_start_range?: [number, number] | null;
  /** The broker's words for a queued lease's start ("in 1–3 min", "unknown"): shown as is, never re-derived. */
  estimate_text?: string | null;
  /** Why a queued lease waits, in the broker's words (`reason` a slug for scripts). */
  wait?: IWait | null;
  /** Why an ended lease ended, as a sentence ("revoked: idle for 10 min while others waited"). */
  reason_text?: string | null;
  min_gpus: number;
  max_gpus: number;
  fraction: number;
  labels: Record<string, string>;
  /** What it used (from the broker's samples; null before it was granted). */
  usage?: ILeaseUsage | null;
  /** Who holds it, in the broker's words: its holder process (a kernel), or its heartbeats. */
  holder?: ILeaseHolder | null;
}

/** A lease's holder: the kernel process it ends with (pid), or none (heartbeats); `alive` false while a holder that
 * is gone (or silent) still holds it, until the broker ends it; `text` says so in words. */
export interface ILeaseHolder {
  pid: number | null;
  watched: boolean;
  alive: boolean;
  text: string;
}

/** A lease's usage figures: bytes and percent; null where not measured. */
export interface ILeaseUsage {
  samples: number;
  peak_memory: number | null;
  held_memory: number;
  mean_utilization: number | null;
  peak_utilization: number | null;
  source: 'process' | 'device' | null;
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

/** Why a queued request waits: a slug (gpus_busy, quota, budget, reservation, whole_node, no_gpu_type, fair_share,
 * priority, queue) and the broker's words for it. */
export interface IWait {
  reason: string;
  text: string;
}

export interface IArtifact {
  lease_id: string;
  path: string;
  relative_path: string | null;
  modified: number;
  meta: Record<string, any> | null;
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

export interface IEvent {
  schema: string;
  type: string;
  [key: string]: any;
}
