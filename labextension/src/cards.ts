/** The GPU cards of the sidebar: what a GPU is doing and for whom, with a live chart of the last minutes. */

import { IGpu } from './api';
import { gpuChart } from './chart';
import { counter, formatBytes, formatDuration, h, plural } from './format';
import { gpuKind } from './gputype';
import { ILease, ILeaseUsage } from './leaseView';
import { GpuLeaseModel } from './model';

/** An idle countdown only for a lease that can go idle: the broker gives no deadline while it is busy, and none is
 * shown while a cell of the lease runs (its worker attached) whatever the last view said. */
export function showsIdleCountdown(l: ILease): boolean {
  return !!l.idle_deadline && !(l.pids?.length > 0);
}

/** A piece of a card's state: words, or a countdown to an epoch followed by words (" left"). */
type Piece = string | { until: number; then: string };

/** How a GPU card reads at a glance: its kind (the card's `data-state`) and its words, with live countdowns. */
export function gpuStatus(model: GpuLeaseModel, gpu: IGpu): { kind: string; text: string; pieces: Piece[] } {
  const now = model.now();
  const st = (kind: string, ...pieces: Piece[]) => ({
    kind,
    pieces,
    text: pieces.map(p => (typeof p === 'string' ? p : `${formatDuration(p.until - now)}${p.then}`)).join('')
  });
  const mine = gpu.holders.filter(x => x.mine);
  if (model.connection === 'unreachable') {
    // the last state fetched is not what the GPU does now: say nothing we do not know
    return st('unknown', 'unknown: broker unreachable');
  }
  if (gpu.state === 'unhealthy') {
    return st('unhealthy', 'unhealthy');
  }
  if (gpu.state === 'draining') {
    return st('draining', 'draining');
  }
  if (gpu.state === 'reserved') {
    const r = gpu.reservation;
    if (!r) {
      return st('reserved', 'reserved');
    }
    const who = r.user ? (r.user === model.info?.user?.name ? 'you' : r.user) : `@${r.group}`;
    return st('reserved', `reserved for ${who} · `, { until: r.end, then: ' left' });
  }
  if (gpu.state === 'shared') {
    const users = [...new Set(gpu.holders.map(x => (x.mine ? 'you' : x.user)))].join(', ');
    return st(mine.length ? 'shared-mine' : 'shared', `shared: ${plural(gpu.holders.length, 'share')} (${users})`);
  }
  if (gpu.state === 'leased') {
    if (mine.length) {
      const lease: ILease | undefined = model.leases.find(l => l.id === mine[0].lease_id);
      const pieces: Piece[] = ['yours'];
      // the lease's own end (as its row in "Your leases" counts it), the holder's when the lease is not listed
      const end = lease?.expires_at ?? mine[0].expires_at;
      if (end) {
        pieces.push(' · ', { until: end, then: ' left' });
      }
      if (lease && showsIdleCountdown(lease)) {
        pieces.push(' · idle in ', { until: lease.idle_deadline as number, then: '' });
      }
      return st('yours', ...pieces);
    }
    return st('held', `held by ${gpu.holders.map(x => x.user).join(', ')}`);
  }
  return st(gpu.state, gpu.state);
}

/** One GPU's card. */
export function gpuCard(model: GpuLeaseModel, g: IGpu): HTMLElement {
  const st = gpuStatus(model, g);
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
    h(
      'div',
      { class: 'jp-GpuLease-state' },
      st.pieces.flatMap(p => (typeof p === 'string' ? [p] : [counter('until', p.until, model.now()), p.then]))
    ),
    figures(g),
    chart(model, g)
  );
}

/** Bring a rendered card's figures and chart up to a new sample (no re-render of the panel). */
export function updateCardSample(card: HTMLElement, model: GpuLeaseModel, g: IGpu): void {
  card.querySelector('.jp-GpuLease-mem')?.replaceWith(figures(g));
  card.querySelector('.jp-GpuLease-chart')?.replaceWith(chart(model, g));
}

function figures(g: IGpu): HTMLElement {
  return h(
    'div',
    { class: 'jp-GpuLease-mem' },
    h('span', { class: 'jp-GpuLease-memUsed' }, `${formatBytes(g.memory_used)} / ${formatBytes(g.memory_total)}`),
    h('span', { class: 'jp-GpuLease-util' }, ` · ${g.utilization.toFixed(0)}%`)
  );
}

function chart(model: GpuLeaseModel, g: IGpu): SVGElement {
  const history = model.history;
  return gpuChart(history.points(g.id), model.now(), history.seconds, `GPU ${g.index} utilisation and memory`);
}

/** 'peak 3.2 GiB of 40 GiB · util 62% (peak 94%)': what a lease used so far, for its card; '' before a sample. */
export function leaseUsage(u: ILeaseUsage | null | undefined): string {
  if (!u || u.peak_memory === null) {
    return '';
  }
  const held = u.held_memory ? ` of ${formatBytes(u.held_memory)}` : '';
  const util = u.mean_utilization === null ? '' : ` · util ${Math.round(u.mean_utilization)}% (peak ${Math.round(u.peak_utilization ?? 0)}%)`;
  return `peak ${formatBytes(u.peak_memory)}${held}${util}`;
}

/**
 * The broker's words for a suspended lease ("suspended since 14:05 (idle); resumes with its next cell") or for one
 * it asks to suspend ("asked to suspend by 14:06 (idle)"), shown as they come; [] otherwise.
 */
export function suspendWords(l: Pick<ILease, 'phase' | 'suspend' | 'suspended'>): string[] {
  if (l.phase === 'suspended' && l.suspended?.text) {
    return [l.suspended.text];
  }
  if (l.phase === 'holding' && l.suspend?.text) {
    return [l.suspend.text];
  }
  return [];
}
