import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { cancelRequest, extendLease, releaseLease, revokeLease } from './actions';
import { IArtifact, IQueueEntry } from './api';
import { gpuCard, leaseUsage, showsIdleCountdown, suspendWords, updateCardSample } from './cards';
import { counter, formatClock, gpusWanted, h, tickCounters, waitWords } from './format';
import { ILease } from './leaseView';
import { GpuLeaseModel } from './model';
import { wants } from './gputype';

export const PANEL_ID = 'gpulease-panel';
const FULL_RENDER_TICKS = 5; // the cards' states: every 5 s
const QUEUE_REFRESH_TICKS = 30; // while someone waits: the broker's estimates every 30 s

const GPU_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" fill="#616161">' +
  '<path d="M3 6h15a3 3 0 0 1 3 3v6a3 3 0 0 1-3 3H6v2H4V8H3zm5 3a3 3 0 1 0 0 6 3 3 0 0 0 0-6zm6 0v6h2V9zm3 0v6h2V9z"/>' +
  '</g></svg>';

export const gpuIcon = new LabIcon({ name: 'jupyter-gpulease:gpu', svgstr: GPU_SVG });

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
    model.sampled.connect(() => this.updateSamples(), this);
    this.render();
    // counters tick every second and the rest every few, locally, without asking the server
    let ticks = 0;
    this._ticker = window.setInterval(() => {
      if (!this.isVisible) {
        return;
      }
      if (++ticks % QUEUE_REFRESH_TICKS === 0 && this.model.queue.length) {
        this.model.scheduleRefresh(); // the broker's start estimates, in its words, as they are now
      } else if (ticks % FULL_RENDER_TICKS === 0) {
        this.render();
      } else {
        tickCounters(this.node, this.model.now());
      }
    }, 1000);
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
      h('div', { class: 'jp-GpuLease-cards', role: 'list', 'aria-label': 'GPUs' }, m.gpus.map(g => gpuCard(m, g))),
      this.queueSection(),
      this.leaseSection('Your leases', m.leases.filter(l => l.phase !== 'ended'), false),
      m.isAdmin && m.allLeases ? this.leaseSection('All leases (admin)', m.allLeases.filter(l => l.phase !== 'ended'), true) : null,
      this.artifactSection()
    );
    this.node.replaceChildren(body);
    if (focused) {
      const el = this.node.querySelector<HTMLElement>(`[data-focus-key="${CSS.escape(focused)}"]`);
      el?.focus();
    }
  }

  /** A new sample: the cards' figures and charts only (a full render would disturb clicks and focus). */
  updateSamples(): void {
    if (!this.isVisible) {
      return;
    }
    for (const g of this.model.gpus) {
      const el = this.node.querySelector<HTMLElement>(`.jp-GpuLease-card[data-gpu-id="${CSS.escape(g.id)}"]`);
      if (el) {
        updateCardSample(el, this.model, g);
      }
    }
  }

  private queueSection(): HTMLElement | null {
    const q = this.model.queue;
    return h(
      'section',
      { class: 'jp-GpuLease-section', 'aria-label': 'Queue', 'data-section': 'queue' },
      h('h3', {}, `Queue (${q.length})`),
      q.length === 0
        ? h('div', { class: 'jp-GpuLease-empty' }, 'Nobody is waiting.')
        : h('ol', { class: 'jp-GpuLease-queue' }, q.map(e => this.queueItem(e)))
    );
  }

  private queueItem(e: IQueueEntry): HTMLElement {
    const now = this.model.now();
    return h(
      'li',
      { class: e.mine ? 'jp-GpuLease-queueItem jp-mod-mine' : 'jp-GpuLease-queueItem', 'data-lease-id': e.lease_id ?? '' },
      `#${e.position} ${e.mine ? 'you' : e.user}: ${gpusWanted(e)}${wants(e)}, waited `,
      counter('since', now - this.model.waited(e), now, 'jp-GpuLease-waited'),
      waitWords(e).flatMap(w => [' · ', h('span', { class: 'jp-GpuLease-waitWhy' }, w)])
    );
  }

  private leaseSection(title: string, leases: ILease[], admin: boolean): HTMLElement {
    return h(
      'section',
      { class: 'jp-GpuLease-section', 'aria-label': title, 'data-section': admin ? 'all-leases' : 'my-leases' },
      h('h3', {}, `${title} (${leases.length})`),
      leases.length === 0
        ? h('div', { class: 'jp-GpuLease-empty' }, 'No leases.')
        : h('ul', { class: 'jp-GpuLease-leases' }, leases.map(l => this.leaseItem(l, admin)))
    );
  }

  private leaseItem(l: ILease, admin: boolean): HTMLElement {
    const m = this.model;
    const now = m.now();
    const gpus = l.devices.map(d => d.index).join(', ');
    const parts: (Node | string)[][] = [[l.state]];
    if (l.expires_at && l.phase === 'holding') {
      parts.push([counter('until', l.expires_at, now), ' left']);
    }
    if (showsIdleCountdown(l)) {
      parts.push(['idle in ', counter('until', l.idle_deadline as number, now)]);
    }
    if (l.phase === 'queued' && l.position) {
      parts.push([`position ${l.position}`]);
    }
    if (l.phase === 'queued') {
      parts.push(...waitWords(l).map(w => [h('span', { class: 'jp-GpuLease-waitWhy' }, w)]));
    }
    parts.push(...suspendWords(l).map(w => [h('span', { class: 'jp-GpuLease-suspended' }, w)]));
    if (admin && l.holder && !l.holder.alive && l.holder.text) {
      parts.push([h('span', { class: 'jp-GpuLease-holderGone', title: 'Its holder is gone: the broker ends it' }, l.holder.text)]);
    }
    const button = (cls: string, label: string, key: string, text: string, fn: () => Promise<void>) =>
      h('button', { class: `jp-Button jp-mod-styled ${cls}`, 'aria-label': label, 'data-focus-key': `${key}:${l.id}`, onclick: () => void fn() }, text);
    const own = m.isMine(l) || !admin;
    return h(
      'li',
      { class: 'jp-GpuLease-lease', 'data-lease-id': l.id, 'data-state': l.state },
      h('div', { class: 'jp-GpuLease-leaseTitle' }, `${admin ? `${l.user}: ` : ''}${l.id}`, gpus ? ` (${l.devices.length === 1 ? 'GPU' : 'GPUs'} ${gpus})` : ''),
      h('div', { class: 'jp-GpuLease-leaseState' }, parts.flatMap((p, i) => (i ? [' · ', ...p] : p))),
      leaseUsage(l.usage)
        ? h('div', { class: 'jp-GpuLease-leaseUsage', title: 'GPU memory and utilisation this lease used (peak memory of what it held; mean utilisation)' }, leaseUsage(l.usage))
        : null,
      h(
        'div',
        { class: 'jp-GpuLease-actions' },
        own && l.phase === 'queued'
          ? button('jp-mod-reject jp-GpuLease-cancel', `Cancel request ${l.id}`, 'cancel', 'Cancel', () => cancelRequest(m, l))
          : null,
        own && l.phase === 'holding'
          ? [
              button('jp-mod-reject jp-GpuLease-release', `Release lease ${l.id}`, 'release', 'Release', () => releaseLease(m, l)),
              button('jp-GpuLease-extend', `Extend lease ${l.id}`, 'extend', 'Extend…', () => extendLease(m, l))
            ]
          : own && l.phase === 'suspended'
            ? button('jp-mod-reject jp-GpuLease-release', `Release lease ${l.id}`, 'release', 'Release', () => releaseLease(m, l))
            : null,
        admin
          ? button('jp-mod-warn jp-GpuLease-revoke', `Revoke lease ${l.id} of ${l.user}`, 'revoke', 'Revoke…', () => revokeLease(m, l))
          : null
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
                h('span', { class: 'jp-GpuLease-artifactWhen' }, ` ${formatClock(a.modified)}`)
              )
            )
          )
    );
  }

  private _ticker = 0;
}
