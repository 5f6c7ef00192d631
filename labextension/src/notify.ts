/**
 * JupyterLab notifications about your own leases: a queued cell granted, a background cell ended, a preemption,
 * an idle or expiry warning, a revocation. Each kind can be turned off in the settings (schema/plugin.json);
 * while the tab is hidden they also go to the desktop (desktop.ts).
 */

import { JupyterFrontEnd } from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { PageConfig } from '@jupyterlab/coreutils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';

import { extendLease, keepActive } from './actions';
import { IEvent } from './api';
import { ILease } from './leaseView';
import { DesktopNotifier } from './desktop';
import { baseName, INotice, labPath, noticeFor, NOTICE_KINDS, NoticeKind, WAITED_AT_LEAST_S } from './messages';
import { GpuLeaseModel } from './model';

/** How long a success or info notice stays up while you look at the tab (kept in the center afterwards). */
const AUTO_CLOSE_MS = 15000;
/** Events told, remembered so a replay is not told twice (bounded). */
const REMEMBER = 500;

/** The part of a notebook panel this module uses to select a cell (typed here: no @jupyterlab/notebook). */
interface INotebookLike {
  content?: {
    widgets?: ReadonlyArray<{
      model?: { id?: string; type?: string; executionCount?: number | null; sharedModel?: { getId?: () => string; getSource?: () => string } };
    }>;
    activeCellIndex: number;
    scrollToItem?: (index: number) => Promise<void>;
  };
}

export class LeaseNotifier {
  readonly desktop = new DesktopNotifier();
  /** The kinds turned on (the settings' booleans of the same names). */
  readonly enabled: Record<NoticeKind, boolean> = {
    granted: true,
    background: true,
    preemption: true,
    warning: true,
    revoked: true
  };

  constructor(
    private app: JupyterFrontEnd,
    private model: GpuLeaseModel,
    private openPanel: () => void
  ) {
    model.ownEvent.connect((_, event) => this.onEvent(event), this);
  }

  /** Follow the settings: read them now and on every change. */
  async followSettings(registry: ISettingRegistry, pluginId: string): Promise<void> {
    const settings = await registry.load(pluginId);
    const apply = () => {
      for (const kind of NOTICE_KINDS) {
        this.enabled[kind] = settings.get(kind).composite !== false;
      }
      this.desktop.enabled = settings.get('desktop').composite !== false;
    };
    apply();
    settings.changed.connect(apply);
  }

  onEvent(event: IEvent): void {
    const known = this.model.leases.find(l => l.id === (event.lease_id ?? event.lease?.id));
    this._offerDesktop(event);
    this._takeAnsweredWarnings(event);
    const notice = noticeFor(event, known);
    if (!notice || !this.enabled[notice.kind] || this._told.has(notice.key)) {
      return;
    }
    this._told.add(notice.key);
    if (notice.kind === 'warning' || notice.kind === 'preemption') {
      this._warned.set(notice.leaseId, notice.warning ?? notice.kind);
    }
    if (this._told.size > REMEMBER) {
      this._told.delete(this._told.values().next().value as string);
    }
    // in the order the events came, though resolving a notebook's path may ask the server
    this._pending = this._pending.then(() => this._resolve(notice)).then(n => this._show(n));
  }

  /** The notice with its notebook as a path under the server's root, or none to open. */
  private async _resolve(notice: INotice): Promise<INotice> {
    if (!notice.notebook?.startsWith('/')) {
      return notice;
    }
    let sessions: string[] = [];
    try {
      const manager = this.app.serviceManager.sessions;
      await manager.refreshRunning();
      sessions = Array.from(manager.running(), s => s.path);
    } catch {
      // no sessions to match: the server root may still do
    }
    return { ...notice, notebook: labPath(notice.notebook, PageConfig.getOption('serverRoot'), sessions) };
  }

  /**
   * Open the notebook a notice is about and select its cell: the cell that ran, by the id the kernel labelled the
   * request with; without one (an older kernel), the cell whose prompt shows In[n], else the %%gpu cell still running.
   */
  async openNotebook(path: string, cell?: string, cellId?: string): Promise<void> {
    const widget = (await this.app.commands.execute('docmanager:open', { path })) as INotebookLike | undefined;
    const content = widget?.content;
    if (!content?.widgets) {
      return;
    }
    const idOf = (c: (typeof content.widgets)[number]) => c.model?.id ?? c.model?.sharedModel?.getId?.();
    let index = cellId ? content.widgets.findIndex(c => idOf(c) === cellId) : -1;
    const n = Number(/In\[(\d+)\]/.exec(cell ?? '')?.[1] ?? NaN);
    if (index < 0 && Number.isFinite(n)) {
      // the cell shows In[n] once it has run; while it runs it is the %%gpu cell without a count yet
      index = content.widgets.findIndex(c => c.model?.executionCount === n);
      if (index < 0) {
        index = content.widgets.findIndex(
          c =>
            c.model?.type === 'code' &&
            c.model.executionCount === null &&
            String(c.model.sharedModel?.getSource?.() ?? '').startsWith('%%gpu')
        );
      }
    }
    if (index >= 0) {
      content.activeCellIndex = index;
      void content.scrollToItem?.(index);
    }
  }

  private _show(notice: INotice): void {
    const open = notice.notebook
      ? () => void this.openNotebook(notice.notebook as string, notice.cell ?? undefined, notice.cellId ?? undefined)
      : () => this.openPanel();
    const hidden = document.visibilityState === 'hidden';
    const sticky = hidden || notice.level === 'warning' || notice.level === 'error';
    const id = Notification.emit(notice.text, notice.level, {
      autoClose: sticky ? false : AUTO_CLOSE_MS,
      actions: this._actions(notice)
    });
    // a newer notice about the same thing replaces the older; a lease that ended has nothing left to warn of
    const replaced = notice.slot.endsWith(':end') ? [notice.slot, `${notice.leaseId}:warning`] : [notice.slot];
    for (const slot of replaced) {
      const previous = this._slots.get(slot);
      if (previous) {
        Notification.dismiss(previous);
        this._slots.delete(slot);
      }
    }
    this._slots.set(notice.slot, id);
    this.desktop.show(notice, open);
  }

  private _actions(notice: INotice): Notification.IAction[] {
    const actions: Notification.IAction[] = [];
    const leaseId = notice.leaseId;
    if (notice.kind === 'warning') {
      const idle = notice.warning === 'idle';
      actions.push({
        label: idle ? 'Keep it' : 'Extend…',
        caption: idle ? `Mark lease ${leaseId} in use` : `Extend lease ${leaseId}`,
        callback: () => {
          const lease = this.model.leases.find(l => l.id === leaseId);
          if (idle) {
            void keepActive(this.model, leaseId);
          } else if (lease) {
            void extendLease(this.model, lease);
          } else {
            Notification.error(`Lease ${leaseId} has ended: nothing to extend.`, { autoClose: 8000 });
          }
        }
      });
    }
    if (notice.notebook) {
      const name = baseName(notice.notebook);
      actions.push({
        label: `Open ${name}`,
        caption: `Open the notebook ${notice.notebook}`,
        callback: () =>
          void this.openNotebook(notice.notebook as string, notice.cell ?? undefined, notice.cellId ?? undefined)
      });
    }
    actions.push({ label: 'Show', caption: 'Show the GPU lease panel', displayType: 'link', callback: this.openPanel });
    return actions;
  }

  /**
   * A warning that no longer holds goes: every warning about a lease that ended (a release too, which is told
   * nothing), an expiry warning once the lease was extended, an idle warning once it is in use again.
   */
  private _takeAnsweredWarnings(event: IEvent): void {
    const lease = event.lease as ILease | undefined;
    const kind = lease?.id ? this._warned.get(lease.id) : undefined;
    if (event.type !== 'lease' || !lease?.id || kind === undefined) {
      return;
    }
    const change = String(event.change ?? '');
    const answered =
      lease.phase === 'ended' ||
      (kind === 'expiry' && change === 'renewed') ||
      (kind === 'idle' && lease.state === 'active');
    if (!answered) {
      return;
    }
    this._warned.delete(lease.id);
    // in order: after a warning still being shown
    this._pending = this._pending.then(() => {
      const slot = `${lease.id}:warning`;
      const shown = this._slots.get(slot);
      if (shown) {
        Notification.dismiss(shown);
        this._slots.delete(slot);
      }
    });
  }

  /**
   * A request that really waits, or a background cell that starts: the moment to offer desktop notifications. A
   * request enters the queue before every grant, even one at once: it is offered only when it is still queued a
   * moment later (no event took it out of the queue meanwhile).
   */
  private _offerDesktop(event: IEvent): void {
    const lease = event.lease as ILease | undefined;
    if (event.type !== 'lease' || !lease?.id) {
      return;
    }
    if (lease.phase === 'queued' && event.previous === null) {
      this._queued.add(lease.id);
      window.setTimeout(() => {
        if (this._queued.delete(lease.id)) {
          this.desktop.offerOnce('Your GPU request waits in the queue.');
        }
      }, WAITED_AT_LEAST_S * 1000);
      return;
    }
    if (lease.phase !== 'queued') {
      this._queued.delete(lease.id);
    }
    if (lease.labels?.bg && event.change === 'granted') {
      this.desktop.offerOnce(`Background cell ${lease.labels.bg} runs.`);
    }
  }

  private _pending: Promise<void> = Promise.resolve();
  private _told = new Set<string>();
  private _slots = new Map<string, string>();
  /** Leases with a warning shown, and its kind ('idle', 'expiry', 'preemption'). */
  private _warned = new Map<string, string>();
  /** Requests just queued, until they leave the queue. */
  private _queued = new Set<string>();
}
