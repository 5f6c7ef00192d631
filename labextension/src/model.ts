import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import {
  eventsURL,
  GpuLeaseError,
  IArtifact,
  IEvent,
  IGpu,
  IGpuSample,
  IInfo,
  IQueueEntry,
  requestAPI
} from './api';
import { ILease } from './leaseView';

import { SampleHistory } from './history';

export type Connection = 'connecting' | 'connected' | 'unreachable';

const MAX_BACKOFF_MS = 30000;

/** The sidebar's state: fetched from the server extension, refreshed on broker events. */
export class GpuLeaseModel {
  readonly settings = ServerConnection.makeSettings();
  info: IInfo | null = null;
  gpus: IGpu[] = [];
  queue: IQueueEntry[] = [];
  leases: ILease[] = [];
  allLeases: ILease[] | null = null;
  artifacts: IArtifact[] = [];
  connection: Connection = 'connecting';
  message = '';
  /** Broker time minus local time, in seconds. */
  skew = 0;
  /** Broker time of the last fetch of the queue (its `waited_seconds` count from then). */
  queueFetchedAt = 0;
  /** The last minutes of each GPU's utilisation and memory, from the `gpu_samples` events. */
  readonly history = new SampleHistory();

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** A `gpu_samples` event updated the GPUs' figures and history (no refetch). */
  get sampled(): ISignal<this, void> {
    return this._sampled;
  }

  /**
   * An event about one of your own leases: a lease change (`lease`), an idle or expiry warning (`warning`),
   * a preemption warning (`lease.preempting`). Admins' streams carry everyone's: only yours come through.
   */
  get ownEvent(): ISignal<this, IEvent> {
    return this._ownEvent;
  }

  get isAdmin(): boolean {
    return !!this.info?.user?.admin;
  }

  now(): number {
    return Date.now() / 1000 + this.skew;
  }

  start(): void {
    this._connect();
    void this.refresh();
  }

  dispose(): void {
    this._disposed = true;
    window.clearTimeout(this._reconnectTimer);
    window.clearTimeout(this._refreshTimer);
    this._ws?.close();
  }

  /** Refetch everything soon (coalesces bursts of events into one fetch). */
  scheduleRefresh(delayMs = 150): void {
    if (this._refreshTimer) {
      return;
    }
    this._refreshTimer = window.setTimeout(() => {
      this._refreshTimer = 0;
      void this.refresh();
    }, delayMs);
  }

  async refresh(): Promise<void> {
    if (this._refreshing) {
      this._refreshAgain = true;
      return this._refreshing;
    }
    this._refreshing = this._refresh();
    try {
      await this._refreshing;
    } finally {
      this._refreshing = null;
      if (this._refreshAgain) {
        this._refreshAgain = false;
        void this.refresh();
      }
    }
  }

  private async _refresh(): Promise<void> {
    try {
      const [info, gpus, queue, leases] = await Promise.all([
        requestAPI<IInfo>('info', {}, this.settings),
        requestAPI<{ gpus: IGpu[] }>('gpus', {}, this.settings),
        requestAPI<{ queue: IQueueEntry[] }>('queue', {}, this.settings),
        requestAPI<{ leases: ILease[] }>('leases', {}, this.settings)
      ]);
      this.info = info;
      this.skew = info.time - Date.now() / 1000;
      this.gpus = gpus.gpus;
      this.queue = queue.queue;
      this.queueFetchedAt = info.time;
      this.leases = leases.leases.filter(l => l.user === info.user.name);
      this.history.seed(info.time, this.gpus);
      this.allLeases = null;
      if (info.user.admin) {
        try {
          this.allLeases = (
            await requestAPI<{ leases: ILease[] }>('leases?all=1', {}, this.settings)
          ).leases;
        } catch {
          this.allLeases = null;
        }
      }
      try {
        this.artifacts = (
          await requestAPI<{ artifacts: IArtifact[] }>('artifacts?limit=10', {}, this.settings)
        ).artifacts;
      } catch {
        this.artifacts = [];
      }
      if (this.connection === 'unreachable' && this._ws?.readyState !== WebSocket.OPEN) {
        // the REST API answers again: reconnect the event stream now
        this._reconnectNow();
      }
      if (this.connection !== 'connected' && this._ws?.readyState === WebSocket.OPEN) {
        this.connection = 'connected';
      }
      this.message = '';
    } catch (error) {
      this.connection = 'unreachable';
      this.message =
        error instanceof GpuLeaseError ? error.message : `GPU lease broker unreachable: ${error}`;
    }
    this._changed.emit();
  }

  /** Release a lease you hold, or cancel a queued request (the broker answers the lease as it ended). */
  release(leaseId: string): Promise<ILease> {
    return this._action(`leases/${leaseId}/release`, { reason: 'released from the JupyterLab sidebar' });
  }

  /** Move a lease's end `seconds` later (the broker adds them to the end it has, not to our idea of it). */
  extend(lease: ILease, seconds: number): Promise<ILease> {
    return this._action(`leases/${lease.id}/renew`, { extend_seconds: seconds });
  }

  /** Answer an idle warning: "I still use it" marks the lease active. */
  keepActive(leaseId: string): Promise<ILease> {
    return this._action(`leases/${leaseId}/heartbeat`, { active: true });
  }

  revoke(leaseId: string, reason: string): Promise<ILease> {
    return this._action(`leases/${leaseId}/revoke`, { reason });
  }

  /** Seconds a queued entry has waited, counted locally from the last fetch. */
  waited(entry: IQueueEntry): number {
    return entry.waited_seconds + Math.max(0, this.now() - this.queueFetchedAt);
  }

  isMine(lease: ILease): boolean {
    return lease.user === this.info?.user?.name;
  }

  private async _action(path: string, body: unknown): Promise<ILease> {
    try {
      return await requestAPI<ILease>(path, { method: 'POST', body: JSON.stringify(body) }, this.settings);
    } finally {
      await this.refresh();
    }
  }

  // ------------------------------------------------------------ events
  private _connect(): void {
    if (this._disposed) {
      return;
    }
    const ws = new WebSocket(eventsURL(this.settings));
    this._ws = ws;
    ws.onopen = () => {
      this._backoff = 1000;
    };
    ws.onmessage = msg => {
      let event: IEvent;
      try {
        event = JSON.parse(String(msg.data));
      } catch {
        return;
      }
      this._onEvent(event);
    };
    ws.onclose = () => {
      if (this._ws !== ws) {
        return;
      }
      this._ws = null;
      if (this.connection !== 'unreachable') {
        this.connection = 'unreachable';
        this.message = this.message || 'GPU lease broker unreachable: reconnecting';
        this._changed.emit();
      }
      this._reconnectTimer = window.setTimeout(() => this._connect(), this._backoff);
      this._backoff = Math.min(MAX_BACKOFF_MS, this._backoff * 2);
    };
  }

  private _reconnectNow(): void {
    window.clearTimeout(this._reconnectTimer);
    if (!this._ws) {
      this._connect();
    }
  }

  private _onEvent(event: IEvent): void {
    switch (event.type) {
      case 'broker_unreachable':
        this.connection = 'unreachable';
        this.message = event.message ?? 'GPU lease broker unreachable';
        this._changed.emit();
        return;
      case 'hello':
        this.connection = 'connected';
        this.message = '';
        this.scheduleRefresh(0);
        return;
      case 'gpu_samples':
        this._onSamples(event.time ?? this.now(), event.gpus ?? []);
        return;
      case 'lease':
      case 'lease.preempting':
      case 'warning':
        if (event.user !== undefined && event.user === this.info?.user?.name) {
          this._ownEvent.emit(event);
        }
        this.scheduleRefresh();
        return;
      default:
        this.scheduleRefresh();
    }
  }

  private _onSamples(time: number, samples: IGpuSample[]): void {
    const byId = new Map(samples.map(s => [s.id, s]));
    for (const g of this.gpus) {
      const s = byId.get(g.id);
      if (s) {
        g.utilization = s.utilization;
        g.memory_used = s.memory_used;
      }
    }
    this.history.add(time, samples, this.gpus);
    this._sampled.emit();
  }

  private _changed = new Signal<this, void>(this);
  private _sampled = new Signal<this, void>(this);
  private _ownEvent = new Signal<this, IEvent>(this);
  private _ws: WebSocket | null = null;
  private _backoff = 1000;
  private _reconnectTimer = 0;
  private _refreshTimer = 0;
  private _refreshing: Promise<void> | null = null;
  private _refreshAgain = false;
  private _disposed = false;
}
