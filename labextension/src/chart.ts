/** A GPU card's live chart: utilisation and memory over the last minutes, as an inline SVG. */

import { formatDuration } from './format';
import { IPoint } from './history';

const SVG = 'http://www.w3.org/2000/svg';
const W = 100;
const H = 24;

/** Until this much history exists, the chart spans the time since its first sample (it fills at once). */
const MIN_SPAN_SECONDS = 30;

/**
 * The chart of `points` over the last `window` seconds before `now` (broker time), or over the time since the
 * first sample while there is less; the newest sample sits at the right.
 */
export function gpuChart(points: IPoint[], now: number, window: number, gpuLabel: string): SVGElement {
  const seconds = points.length ? Math.max(MIN_SPAN_SECONDS, Math.min(window, now - points[0].t)) : window;
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('class', 'jp-GpuLease-chart');
  svg.setAttribute('role', 'img');
  svg.setAttribute('data-samples', String(points.length));
  const last = points[points.length - 1];
  const summary = last
    ? `utilisation ${last.util.toFixed(0)} %, memory ${(last.mem * 100).toFixed(0)} %`
    : 'no samples yet';
  svg.setAttribute('aria-label', `${gpuLabel}, last ${formatDuration(seconds)}: ${summary}`);
  const title = document.createElementNS(SVG, 'title');
  title.textContent = `Utilisation (solid) and memory (dashed), last ${formatDuration(seconds)}`;
  svg.append(title);
  svg.append(line(points, p => p.mem, now, seconds, 'jp-GpuLease-chartMem'));
  svg.append(line(points, p => p.util / 100, now, seconds, 'jp-GpuLease-chartUtil'));
  return svg;
}

/** A polyline of values 0..1; a single sample is drawn as a level line from its time to now. */
function line(points: IPoint[], value: (p: IPoint) => number, now: number, seconds: number, cls: string): SVGElement {
  const x = (t: number) => Math.max(0, Math.min(W, W - ((now - t) / seconds) * W));
  const y = (v: number) => H - 1 - Math.max(0, Math.min(1, v)) * (H - 2);
  const coords = points.map(p => `${x(p.t).toFixed(1)},${y(value(p)).toFixed(1)}`);
  if (points.length) {
    // the latest sample holds until the next one: carry it to the right edge
    coords.push(`${W},${y(value(points[points.length - 1])).toFixed(1)}`);
  }
  const el = document.createElementNS(SVG, 'polyline');
  el.setAttribute('points', coords.join(' '));
  el.setAttribute('class', cls);
  el.setAttribute('fill', 'none');
  el.setAttribute('vector-effect', 'non-scaling-stroke');
  return el;
}
