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

/** "1 GPU", "2 GPUs", "0.5 GPU" (a fraction of one): a count with its noun, singular or plural. */
export function plural(n: number, noun: string, nouns = `${noun}s`): string {
  return `${n} ${n === 1 || (n > 0 && n < 1) ? noun : nouns}`;
}

/** What a request asks for: "1 GPU", "2 GPUs", "1–4 GPUs", "0.25 GPU" (a share of one). */
export function gpusWanted(r: { fraction: number; min_gpus: number; max_gpus: number }): string {
  if (r.fraction < 1) {
    return plural(r.fraction, 'GPU');
  }
  return r.min_gpus === r.max_gpus ? plural(r.min_gpus, 'GPU') : `${r.min_gpus}–${r.max_gpus} GPUs`;
}

/**
 * What the sidebar says of a queued request beside its wait: the broker's start estimate ("start: in 1–3 min") and
 * why it waits, each in the broker's words as they come (nothing when the broker does not say).
 */
export function waitWords(e: { estimate_text?: string | null; wait?: { text?: string } | null }): string[] {
  const words: string[] = [];
  if (e.estimate_text) {
    words.push(`start: ${e.estimate_text}`);
  }
  if (e.wait?.text) {
    words.push(e.wait.text);
  }
  return words;
}

type CounterKind = 'since' | 'until';

/** The time between now and `epoch`, counting up (`since`) or down (`until`). */
function counted(kind: CounterKind, epoch: number, now: number): string {
  return formatDuration(kind === 'since' ? now - epoch : epoch - now);
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
    const kind: CounterKind = el.dataset.count === 'since' ? 'since' : 'until';
    const text = counted(kind, Number(el.dataset.epoch), now);
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
