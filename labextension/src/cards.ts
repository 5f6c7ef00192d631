/** The GPU cards of the sidebar: what a GPU is doing and for whom, with a live chart of the last minutes. */

import { IGpu, ILeaseUsage } from './api';
import { gpuChart } from './chart';
import { formatBytes, formatDuration, h } from './format';
import { gpuKind } from './gputype';
import { GpuLeaseModel } from './model';

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
    h('div', { class: 'jp-GpuLease-state' }, st.text),
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
