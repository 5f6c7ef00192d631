import { Dialog, InputDialog, Notification, showErrorMessage } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { IArtifact, IGpu, ILease } from './api';
import { formatBytes, formatDuration, h, sparkline } from './format';
import { GpuLeaseModel } from './model';
import { gpuKind, wants } from './gputype';

export const PANEL_ID = 'gpulease-panel';

const GPU_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" fill="#616161">' +
  '<path d="M3 6h15a3 3 0 0 1 3 3v6a3 3 0 0 1-3 3H6v2H4V8H3zm5 3a3 3 0 1 0 0 6 3 3 0 0 0 0-6zm6 0v6h2V9zm3 0v6h2V9z"/>' +
  '</g></svg>';

export const gpuIcon = new LabIcon({ name: 'jupyter-gpulease:gpu', svgstr: GPU_SVG });

/** How a GPU card reads at a glance. */
export function gpuStatus(model: GpuLeaseModel, gpu: IGpu): { kind: string; text: string } {
  const now = model.now();
  const mine = gpu.holders.filter(x => x.mine);
  if (gpu.state === 'unhealthy') {
    return { kind: 'unhealthy', text: 'unhealthy' };
  }
  if (gpu.state === 'draining') {
    return { kind: 'draining', text: 'draining' };
  }
  if (gpu.state === 'reserved') {
    const r = gpu.reservation;
    if (!r) {
      return { kind: 'reserved', text: 'reserved' };
    }
    const who = r.user ? (r.user === model.info?.user?.name ? 'you' : r.user) : `@${r.group}`;
    return { kind: 'reserved', text: `reserved for ${who} · ${formatDuration(r.end - now)} left` };
  }
  if (gpu.state === 'shared') {
    const users = [...new Set(gpu.holders.map(x => (x.mine ? 'you' : x.user)))].join(', ');
    return {
      kind: mine.length ? 'shared-mine' : 'shared',
      text: `shared: ${gpu.holders.length} share${gpu.holders.length === 1 ? '' : 's'} (${users})`
    };
  }
  if (gpu.state === 'leased') {
    if (mine.length) {
      const lease = model.leases.find(l => l.id === mine[0].lease_id);
      const parts = ['yours'];
      if (mine[0].expires_at) {
        parts.push(`${formatDuration(mine[0].expires_at - now)} left`);
      }
      if (lease?.idle_deadline) {
        parts.push(`idle in ${formatDuration(lease.idle_deadline - now)}`);
      }
      return { kind: 'yours', text: parts.join(' · ') };
    }
    return { kind: 'held', text: `held by ${gpu.holders.map(x => x.user).join(', ')}` };
  }
  return { kind: gpu.state, text: gpu.state };
}

/** The left-sidebar panel: GPUs, queue, your leases (all for admins), recent artifacts. */
export class GpuLeasePanel extends Widget {
  constructor(
    readonly model: GpuLeaseModel,
    private openArtifact: (a: IArtifact) => void
  ) {
    super();
    this.id = PANEL_ID;
    this.addClass('jp-GpuLease-panel');
    this.title.icon = gpuIcon;
    this.title.caption = 'GPU leases';
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU leases');
    this.node.tabIndex = -1;
    model.changed.connect(() => this.render(), this);
    this.render();
    // countdowns tick locally, without asking the server
    this._ticker = window.setInterval(() => {
      if (this.isVisible) {
        this.render();
      }
    }, 5000);
  }

  dispose(): void {
    window.clearInterval(this._ticker);
    super.dispose();
  }

  protected onAfterShow(): void {
    this.render();
  }

  render(): void {
    const m = this.model;
    const focused = document.activeElement?.getAttribute('data-focus-key');
    const body = h(
      'div',
      { class: 'jp-GpuLease-body' },
      h(
        'header',
        { class: 'jp-GpuLease-header' },
        h('h2', {}, 'GPUs'),
        m.info?.simulated ? h('span', { class: 'jp-GpuLease-badge jp-GpuLease-simulated', title: 'Simulated GPUs (demo/test inventory), not real hardware' }, 'simulated') : null,
        h(
          'span',
          { class: `jp-GpuLease-connection jp-mod-${m.connection}`, role: 'status', 'aria-live': 'polite' },
          m.connection === 'unreachable' ? 'broker unreachable' : m.connection === 'connecting' ? 'connecting…' : m.info ? `${m.info.summary.free}/${m.info.summary.total} free` : ''
        )
      ),
      m.connection === 'unreachable' && m.message ? h('div', { class: 'jp-GpuLease-error', role: 'alert' }, m.message) : null,
      h('div', { class: 'jp-GpuLease-cards', role: 'list', 'aria-label': 'GPUs' }, m.gpus.map(g => this.card(g))),
      this.queueSection(),
      this.leaseSection('Your leases', m.leases.filter(l => m.holding(l) || l.state === 'queued'), false),
      m.isAdmin && m.allLeases ? this.leaseSection('All leases (admin)', m.allLeases.filter(l => m.holding(l) || l.state === 'queued'), true) : null,
      this.artifactSection()
    );
    this.node.replaceChildren(body);
    if (focused) {
      const el = this.node.querySelector<HTMLElement>(`[data-focus-key="${CSS.escape(focused)}"]`);
      el?.focus();
    }
  }

  private card(g: IGpu): HTMLElement {
    const st = gpuStatus(this.model, g);
    const util = g.utilization > 1 ? g.utilization : g.utilization * 100;
    const label = `GPU ${g.index} ${g.name} on ${g.node}: ${st.text}`;
    return h(
      'div',
      { class: `jp-GpuLease-card jp-mod-${st.kind}`, role: 'listitem', 'data-gpu-id': g.id, 'data-state': st.kind, 'aria-label': label, tabindex: 0, 'data-focus-key': `gpu:${g.id}` },
      h(
        'div',
        { class: 'jp-GpuLease-cardTitle' },
        h('span', { class: 'jp-GpuLease-gpuName' }, `${g.index}: ${g.name}`),
        g.simulated ? h('span', { class: 'jp-GpuLease-badge jp-GpuLease-simulated' }, 'simulated') : null
      ),
      h('div', { class: 'jp-GpuLease-kind', 'data-mig': g.mig ? 'true' : 'false' }, gpuKind(g)),
      h('div', { class: 'jp-GpuLease-state' }, st.text),
      h('div', { class: 'jp-GpuLease-mem' }, `${formatBytes(g.memory_used)} / ${formatBytes(g.memory_total)}`, h('span', { class: 'jp-GpuLease-util' }, ` · ${util.toFixed(0)}%`)),
      sparkline(this.model.samples.get(g.id) ?? [g.utilization], `Utilisation of GPU ${g.index}, recent samples`)
    );
  }

  private queueSection(): HTMLElement | null {
    const q = this.model.queue;
    return h(
      'section',
      { class: 'jp-GpuLease-section', 'aria-label': 'Queue', 'data-section': 'queue' },
      h('h3', {}, `Queue (${q.length})`),
      q.length === 0
        ? h('div', { class: 'jp-GpuLease-empty' }, 'Nobody is waiting.')
        : h(
            'ol',
            { class: 'jp-GpuLease-queue' },
            q.map(e =>
              h(
                'li',
                { class: e.mine ? 'jp-GpuLease-queueItem jp-mod-mine' : 'jp-GpuLease-queueItem', 'data-lease-id': e.lease_id ?? '' },
                `#${e.position} ${e.mine ? 'you' : e.user}: ${e.fraction < 1 ? `${e.fraction} GPU` : e.min_gpus === e.max_gpus ? `${e.min_gpus} GPU` : `${e.min_gpus}-${e.max_gpus} GPUs`}${wants(e)}, waited ${formatDuration(e.waited_seconds)}` +
                  (e.estimated_start ? `, starts in ~${formatDuration(e.estimated_start - this.model.now())}` : '')
              )
            )
          )
    );
  }

  private leaseSection(title: string, leases: ILease[], admin: boolean): HTMLElement {
    const now = this.model.now();
    return h(
      'section',
      { class: 'jp-GpuLease-section', 'aria-label': title, 'data-section': admin ? 'all-leases' : 'my-leases' },
      h('h3', {}, `${title} (${leases.length})`),
      leases.length === 0
        ? h('div', { class: 'jp-GpuLease-empty' }, 'No leases.')
        : h(
            'ul',
            { class: 'jp-GpuLease-leases' },
            leases.map(l => {
              const gpus = l.devices.map(d => d.index).join(', ');
              const parts = [l.state];
              if (l.expires_at && this.model.holding(l)) {
                parts.push(`${formatDuration(l.expires_at - now)} left`);
              }
              if (l.idle_deadline) {
                parts.push(`idle in ${formatDuration(l.idle_deadline - now)}`);
              }
              if (l.state === 'queued' && l.position) {
                parts.push(`position ${l.position}`);
              }
              const mine = this.model.isMine(l);
              return h(
                'li',
                { class: 'jp-GpuLease-lease', 'data-lease-id': l.id, 'data-state': l.state },
                h('div', { class: 'jp-GpuLease-leaseTitle' }, `${admin ? `${l.user}: ` : ''}${l.id}`, gpus ? ` (GPU ${gpus})` : ''),
                h('div', { class: 'jp-GpuLease-leaseState' }, parts.join(' · ')),
                h(
                  'div',
                  { class: 'jp-GpuLease-actions' },
                  mine || !admin
                    ? [
                        h('button', { class: 'jp-Button jp-mod-styled jp-mod-reject jp-GpuLease-release', 'aria-label': `Release lease ${l.id}`, 'data-focus-key': `release:${l.id}`, onclick: () => this.act(() => this.model.release(l.id)) }, 'Release'),
                        this.model.holding(l)
                          ? h('button', { class: 'jp-Button jp-mod-styled jp-GpuLease-extend', 'aria-label': `Extend lease ${l.id}`, 'data-focus-key': `extend:${l.id}`, onclick: () => this.act(() => this.model.extend(l.id)) }, 'Extend')
                          : null
                      ]
                    : null,
                  admin
                    ? h('button', { class: 'jp-Button jp-mod-styled jp-mod-warn jp-GpuLease-revoke', 'aria-label': `Revoke lease ${l.id} of ${l.user}`, 'data-focus-key': `revoke:${l.id}`, onclick: () => void this.revoke(l) }, 'Revoke…')
                    : null
                )
              );
            })
          )
    );
  }

  private artifactSection(): HTMLElement {
    const arts = this.model.artifacts;
    return h(
      'section',
      { class: 'jp-GpuLease-section', 'aria-label': 'Recent artifacts', 'data-section': 'artifacts' },
      h('h3', {}, 'Recent artifacts'),
      arts.length === 0
        ? h('div', { class: 'jp-GpuLease-empty' }, 'None yet: %%gpu cells write them.')
        : h(
            'ul',
            { class: 'jp-GpuLease-artifacts' },
            arts.map(a =>
              h(
                'li',
                {},
                a.relative_path !== null
                  ? h('a', { href: '#', class: 'jp-GpuLease-artifact', 'data-lease-id': a.lease_id, 'aria-label': `Open artifacts of lease ${a.lease_id}`, onclick: (e: Event) => { e.preventDefault(); this.openArtifact(a); } }, a.lease_id)
                  : h('span', { title: a.path }, a.lease_id),
                h('span', { class: 'jp-GpuLease-artifactWhen' }, ` ${new Date(a.modified * 1000).toLocaleString()}`)
              )
            )
          )
    );
  }

  private async act(fn: () => Promise<void>): Promise<void> {
    try {
      await fn();
    } catch (error: any) {
      Notification.error(`GPU lease: ${error?.message ?? error}`, { autoClose: 8000 });
    }
  }

  private async revoke(l: ILease): Promise<void> {
    const result = await InputDialog.getText({
      title: `Revoke lease ${l.id} of ${l.user}`,
      label: 'Reason (shown to the user)',
      placeholder: 'e.g. idle for hours, needed for the training run',
      okLabel: 'Revoke'
    });
    if (!result.button.accept) {
      return;
    }
    const reason = (result.value ?? '').trim();
    if (!reason) {
      await showErrorMessage('Reason required', 'Give a reason: the user sees it.', [Dialog.okButton()]);
      return;
    }
    await this.act(() => this.model.revoke(l.id, reason));
  }

  private _ticker = 0;
}
