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

/**
 * A span of time as every client writes it (gpulease_protocol/text_cases.json): "45 s" under 90 s, then whole
 * minutes ("2 min", "1 h 30 min") and from 48 h on whole days ("2 days"); a negative span is "0 s".
 */
export function formatDuration(seconds: number): string {
  const tenths = Math.round(Math.max(0, seconds) * 10);
  if (tenths < 100) {
    return tenths % 10 ? `${Math.floor(tenths / 10)}.${tenths % 10} s` : `${tenths / 10} s`;
  }
  const s = Math.round(seconds);
  if (s < 90) {
    return `${s} s`;
  }
  const minutes = Math.round(s / 60);
  if (minutes < 60) {
    return `${minutes} min`;
  }
  if (minutes < 48 * 60) {
    const m = minutes % 60;
    return `${Math.floor(minutes / 60)} h${m ? ` ${m} min` : ''}`;
  }
  return `${Math.round(s / 86400)} days`;
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

const UNIT_SECONDS: Record<string, number> = { ms: 0.001, s: 1, m: 60, min: 60, h: 3600, d: 86400 };
const PART = /(\d+(?:\.\d+)?)\s*(ms|min|s|m|h|d)/g;
const MAX_SECONDS = 10 * 365 * 86400;

/**
 * Seconds from a duration a person typed, the protocol's syntax (gpulease_protocol/requests.py `parse_duration`):
 * "90", "90s", "30m", "30min", "1.5h", "1h30m", "1h 30m", "2d12h", "500ms"; null if it is not one.
 */
export function parseDuration(text: string): number | null {
  const t = text.trim().toLowerCase();
  let total: number;
  if (/^\d+(\.\d+)?$/.test(t)) {
    total = Number(t);
  } else if (/^(\d+(\.\d+)?\s*(ms|min|s|m|h|d)\s*)+$/.test(t)) {
    total = [...t.matchAll(PART)].reduce((sum, m) => sum + Number(m[1]) * UNIT_SECONDS[m[2]], 0);
  } else {
    return null;
  }
  return total < MAX_SECONDS ? total : null;
}

const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];

/**
 * A local wall-clock time as every client writes it (gpulease_protocol/text_cases.json): "12:00" the same calendar
 * day, "tomorrow 00:30", "yesterday 23:00", "29 Nov 12:00" in the same year, "2 Jan 2027 09:05" otherwise; English
 * month names, whatever the browser's locale. `now` in epoch seconds.
 */
export function formatClock(epoch: number, now: number = Date.now() / 1000): string {
  const d = new Date(epoch * 1000);
  const n = new Date(now * 1000);
  const two = (x: number) => String(x).padStart(2, '0');
  const time = `${two(d.getHours())}:${two(d.getMinutes())}`;
  // calendar days apart, counted on local dates (a day across a daylight saving change has 23 or 25 hours)
  const days = Math.round(
    (Date.UTC(d.getFullYear(), d.getMonth(), d.getDate()) - Date.UTC(n.getFullYear(), n.getMonth(), n.getDate())) /
      86400000
  );
  if (days === 0) {
    return time;
  }
  if (days === 1 || days === -1) {
    return `${days === 1 ? 'tomorrow' : 'yesterday'} ${time}`;
  }
  const year = d.getFullYear() === n.getFullYear() ? '' : ` ${d.getFullYear()}`;
  return `${d.getDate()} ${MONTHS[d.getMonth()]}${year} ${time}`;
}
