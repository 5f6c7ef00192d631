/** Small formatting helpers for the sidebar. */

export function formatBytes(n: number): string {
  if (!n) {
    return '0 B';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n >= 10 || i === 0 ? n.toFixed(0) : n.toFixed(1)} ${units[i]}`;
}

export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, '0')}s`;
  }
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}

type Child = Node | string | null | undefined | false;

/** Build a DOM element: `h('div', {class: 'x', 'aria-label': 'y'}, child, ...)`. */
export function h(
  tag: string,
  attrs: Record<string, string | number | boolean | null | undefined | ((e: Event) => void)> = {},
  ...children: (Child | Child[])[]
): HTMLElement {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) {
      continue;
    }
    if (typeof v === 'function') {
      el.addEventListener(k.replace(/^on/, ''), v);
    } else if (k === 'class') {
      el.className = String(v);
    } else {
      el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) {
      continue;
    }
    el.append(c);
  }
  return el;
}

/** A wait as a user reads an estimate: whole minutes, then hours, then days (one decimal below 10). */
function about(seconds: number): [string, string] {
  for (const [unit, size, start] of [['d', 86400, 2 * 86400], ['h', 3600, 3570]] as [string, number, number][]) {
    if (seconds >= start) {
      const x = seconds / size;
      return [x < 10 ? String(Math.round(x * 10) / 10) : x.toFixed(0), unit];
    }
  }
  return [String(Math.max(1, Math.round(seconds / 60))), 'min'];
}

/**
 * When a queued request will likely start (broker epoch seconds): "~3 min", a range "~1–4 min" when the broker
 * is unsure (its `estimated_start_range`), "under a minute". As the kernel and the CLI say it.
 */
export function formatEta(start: number, range: number[] | null | undefined, now: number): string {
  const likely = Math.max(0, start - now);
  const [low, high] = range ? [Math.max(0, range[0] - now), Math.max(0, range[1] - now)] : [likely, likely];
  if (high < 60) {
    return 'under a minute';
  }
  let [lo, loUnit] = about(low);
  const [hi, hiUnit] = about(high);
  if (high <= 1.25 * Math.max(low, 60) || (lo === hi && loUnit === hiUnit)) {
    const [value, unit] = about(!range || (low <= likely && likely <= high) ? likely : high);
    return `~${value} ${unit}`;
  }
  if (low < 60) {
    [lo, loUnit] = ['0', hiUnit];
  }
  return loUnit === hiUnit ? `~${lo}–${hi} ${hiUnit}` : `~${lo} ${loUnit}–${hi} ${hiUnit}`;
}

type CounterKind = 'since' | 'until' | 'eta';

/** The time between now and `epoch`, counting up (`since`) or down (`until`, `eta`: as an estimate). */
function counted(kind: CounterKind, epoch: number, now: number, el?: HTMLElement): string {
  if (kind === 'eta') {
    const low = el?.dataset.low;
    return formatEta(epoch, low ? [Number(low), Number(el?.dataset.high)] : null, now);
  }
  return formatDuration(kind === 'since' ? now - epoch : epoch - now);
}

/** An estimated start that stays current ("~1–4 min", `formatEta`), counting down like `counter`. */
export function etaCounter(start: number, range: number[] | null | undefined, now: number): HTMLElement {
  return h(
    'span',
    {
      class: 'jp-GpuLease-counter jp-GpuLease-eta',
      'data-count': 'eta',
      'data-epoch': start,
      'data-low': range ? range[0] : null,
      'data-high': range ? range[1] : null
    },
    formatEta(start, range, now)
  );
}

/**
 * A duration that stays current: a span counting up from `epoch` (`since`) or down to it (`until`), in broker
 * time. `tickCounters` updates every such span under a node, so a counter never needs a refetch or a re-render.
 */
export function counter(kind: 'since' | 'until', epoch: number, now: number, cls = ''): HTMLElement {
  return h(
    'span',
    { class: `jp-GpuLease-counter ${cls}`.trim(), 'data-count': kind, 'data-epoch': epoch },
    counted(kind, epoch, now)
  );
}

export function tickCounters(root: HTMLElement, now: number): void {
  for (const el of root.querySelectorAll<HTMLElement>('[data-count]')) {
    const kind: CounterKind = el.dataset.count === 'since' ? 'since' : el.dataset.count === 'eta' ? 'eta' : 'until';
    const text = counted(kind, Number(el.dataset.epoch), now, el);
    if (el.textContent !== text) {
      el.textContent = text;
    }
  }
}

/** Seconds from a duration a person typed: "15m", "1h30m", "2h", "90s", "1.5h", "1d"; null if it is not one. */
export function parseDuration(text: string): number | null {
  const units: Record<string, number> = { s: 1, m: 60, h: 3600, d: 86400 };
  const t = text.trim().toLowerCase().replace(/\s+/g, '');
  if (!/^(\d+(\.\d+)?[smhd])+$/.test(t)) {
    return null;
  }
  let total = 0;
  for (const m of t.matchAll(/(\d+(?:\.\d+)?)([smhd])/g)) {
    total += Number(m[1]) * units[m[2]];
  }
  return total > 0 ? total : null;
}

/**
 * A local wall-clock time: "14:32" today, "tomorrow 00:07", "Fri 09:15" within the week ahead, the date otherwise
 * (the clock's format is the browser's locale).
 */
export function formatClock(epoch: number, now: Date = new Date()): string {
  const d = new Date(epoch * 1000);
  const time = d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' });
  const midnight = (x: Date) => new Date(x.getFullYear(), x.getMonth(), x.getDate()).getTime();
  const days = Math.round((midnight(d) - midnight(now)) / 86400000);
  if (days === 0) {
    return time;
  }
  if (days === 1) {
    return `tomorrow ${time}`;
  }
  if (days > 1 && days < 7) {
    return `${d.toLocaleDateString([], { weekday: 'short' })} ${time}`;
  }
  return `${d.toLocaleDateString()} ${time}`;
}
