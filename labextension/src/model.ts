import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import {
  eventsURL,
  GpuLeaseError,
  IArtifact,
  IEvent,
  IGpu,
  IInfo,
  ILease,
  IQueueEntry,
  requestAPI
} from './api';

export type Connection = 'connecting' | 'connected' | 'unreachable';

const SPARK_SAMPLES = 40;
const SAMPLE_INTERVAL_MS = 15000; // slow refresh of utilisation samples for the sparklines only
const MAX_BACKOFF_MS = 30000;
const HOLDING = new Set(['granted', 'active', 'idle']);

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
  readonly samples = new Map<string, number[]>();

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** A warning event about one of your leases (idle revocation or expiry coming). */
  get warning(): ISignal<this, IEvent> {
    return this._warning;
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
    this._sampler = window.setInterval(() => {
      if (this.connection === 'connected' && !document.hidden) {
        void this.refresh();
      }
    }, SAMPLE_INTERVAL_MS);
  }

  dispose(): void {
    this._disposed = true;
    window.clearInterval(this._sampler);
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
      this.leases = leases.leases.filter(l => l.user === info.user.name);
      for (const g of this.gpus) {
        const s = this.samples.get(g.id) ?? [];
        s.push(g.utilization);
        this.samples.set(g.id, s.slice(-SPARK_SAMPLES));
      }
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

  async release(leaseId: string): Promise<void> {
    await this._action(`leases/${leaseId}/release`, { reason: 'released from the JupyterLab sidebar' });
  }

  async extend(leaseId: string): Promise<void> {
    const lease = this.leases.find(l => l.id === leaseId);
    await this._action(`leases/${leaseId}/renew`, {
      duration_seconds: lease?.duration_seconds || null
    });
  }

  /** Answer a warning: "I still use it" marks the lease active (idle warning) and renews it (expiry). */
  async keep(leaseId: string, kind: string): Promise<void> {
    if (kind === 'idle') {
      await this._action(`leases/${leaseId}/heartbeat`, { active: true });
    } else {
      await this.extend(leaseId);
    }
  }

  async revoke(leaseId: string, reason: string): Promise<void> {
    await this._action(`leases/${leaseId}/revoke`, { reason });
  }

  isMine(lease: ILease): boolean {
    return lease.user === this.info?.user?.name;
  }

  holding(lease: ILease): boolean {
    return HOLDING.has(lease.state);
  }

  private async _action(path: string, body: unknown): Promise<void> {
    try {
      await requestAPI(path, { method: 'POST', body: JSON.stringify(body) }, this.settings);
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
      case 'warning':
        if (event.user === undefined || event.user === this.info?.user?.name) {
          this._warning.emit(event);
        }
        this.scheduleRefresh();
        return;
      default:
        this.scheduleRefresh();
    }
  }

  private _changed = new Signal<this, void>(this);
  private _warning = new Signal<this, IEvent>(this);
  private _ws: WebSocket | null = null;
  private _backoff = 1000;
  private _reconnectTimer = 0;
  private _refreshTimer = 0;
  private _sampler = 0;
  private _refreshing: Promise<void> | null = null;
  private _refreshAgain = false;
  private _disposed = false;
}
