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

const SVG = 'http://www.w3.org/2000/svg';

/** A utilisation sparkline (values 0..1 or 0..100) as an inline SVG. */
export function sparkline(values: number[], label: string): SVGElement {
  const w = 100;
  const hgt = 20;
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', `0 0 ${w} ${hgt}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('class', 'jp-GpuLease-spark');
  svg.setAttribute('role', 'img');
  svg.setAttribute('aria-label', label);
  const scale = values.some(v => v > 1) ? 100 : 1;
  const pts = values.length ? values : [0];
  const step = pts.length > 1 ? w / (pts.length - 1) : w;
  const coords = pts.map((v, i) => {
    const y = hgt - Math.max(0, Math.min(1, v / scale)) * (hgt - 2) - 1;
    return `${(pts.length > 1 ? i * step : w).toFixed(1)},${y.toFixed(1)}`;
  });
  if (pts.length === 1) {
    coords.unshift(`0,${coords[0].split(',')[1]}`);
  }
  const line = document.createElementNS(SVG, 'polyline');
  line.setAttribute('points', coords.join(' '));
  line.setAttribute('fill', 'none');
  line.setAttribute('vector-effect', 'non-scaling-stroke');
  svg.append(line);
  return svg;
}
