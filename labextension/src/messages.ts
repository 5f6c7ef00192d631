/**
 * What you are told about your own leases, in words (pure: a broker event in, a notice or nothing out).
 * The broker's notifiers (`gpulease notify`) tell the same events by webhook or e-mail when JupyterLab is closed.
 */

import { IEvent } from './api';
import { formatClock, formatDuration, plural } from './format';
import { ILease } from './leaseView';

/** The kinds you can turn off one by one in the settings (schema/plugin.json). */
export type NoticeKind = 'granted' | 'background' | 'preemption' | 'warning' | 'revoked';

export const NOTICE_KINDS: NoticeKind[] = ['granted', 'background', 'preemption', 'warning', 'revoked'];

/** A request granted sooner than this after it was made did not really wait: nothing to tell. */
export const WAITED_AT_LEAST_S = 1;

export interface INotice {
  kind: NoticeKind;
  /** One per event: the same event (a replay after a reconnect) is told once. */
  key: string;
  /** Notices with the same slot replace each other (a newer warning about the same lease). */
  slot: string;
  level: 'success' | 'info' | 'warning' | 'error';
  /** A short title (the desktop notification's). */
  title: string;
  text: string;
  leaseId: string;
  /** The notebook the lease's cell runs in (a path under the server's root), when known. */
  notebook: string | null;
  /** The kernel's name of the cell ("gpu In[3]"), when known. */
  cell: string | null;
  /** The id of the notebook cell that ran (the `cell_id` label, from the front end's execute request), when known. */
  cellId?: string | null;
  /** For warnings: 'idle' (answered by "Keep it") or 'expiry' (answered by "Extend…"). */
  warning?: string;
}

/** "second.ipynb" for "work/second.ipynb". */
export function baseName(path: string): string {
  return path.split('/').pop() || path;
}

/**
 * The notebook's path under the server's root (what `docmanager:open` takes), from the kernel's label: the
 * kernel's JPY_SESSION_NAME, an absolute path under Jupyter Server 2. Null when it is outside the root.
 */
export function labPath(notebook: string, serverRoot: string, sessionPaths: string[]): string | null {
  if (!notebook.startsWith('/')) {
    return notebook;
  }
  const root = serverRoot.replace(/\/+$/, '');
  if (root && notebook.startsWith(`${root}/`)) {
    return notebook.slice(root.length + 1);
  }
  // a root written differently (a symlink, "~"): the running session whose path the label ends with
  const matches = sessionPaths.filter(p => p && notebook.endsWith(`/${p}`));
  return matches.sort((a, b) => b.length - a.length)[0] ?? null;
}

/** "In[3]" for the kernel's label "gpu In[3]". */
function cellName(cell: string | undefined): string {
  return (cell ?? '').replace(/^gpu\s+/, '');
}

/** Where the lease's cell is: "second.ipynb, cell In[3]", or "" without labels. */
export function whereOf(labels: Record<string, string> | undefined): string {
  const l = labels ?? {};
  const notebook = l.notebook ? baseName(l.notebook) : '';
  const cell = cellName(l.cell);
  return [notebook, cell ? `cell ${cell}` : ''].filter(Boolean).join(', ');
}

function gpusOf(lease: ILease): string {
  const devices = lease.devices ?? [];
  const which = devices.map(d => (d.node ? `${d.node}/${d.index}` : `${d.index}`)).join(', ');
  return `${plural(devices.length, 'GPU')}${which ? ` (${which})` : ''}`;
}

/**
 * What happened to a lease that ended, after its name: the broker's `reason_text` as it comes ("was revoked: idle for
 * 10 min while others waited", "ended: the process that held it exited"), never a bare code (`idle_pressure`: kept in
 * `reason` for scripts, not told to people).
 */
export function endedWords(lease: Pick<ILease, 'state' | 'reason_text'>): string {
  const text = (lease.reason_text || lease.state).trim().replace(/\.$/, '');
  return /^ended\b/i.test(text) ? text : `was ${text}`;
}

function leaseNotice(event: IEvent): INotice | null {
  const lease = event.lease as ILease | undefined;
  if (!lease?.id) {
    return null;
  }
  const change = String(event.change ?? '');
  const labels = lease.labels ?? {};
  const where = whereOf(labels);
  const notebook = labels.notebook || null;
  const base = {
    leaseId: lease.id,
    notebook,
    cell: labels.cell || null,
    cellId: labels.cell_id || null,
    slot: `${lease.id}:end`
  };

  if (change === 'granted' && event.previous === 'queued' && lease.granted_at) {
    const waited = lease.granted_at - (lease.created_at ?? lease.granted_at);
    if (waited < WAITED_AT_LEAST_S) {
      return null;
    }
    const until = lease.expires_at ? `, until ${formatClock(lease.expires_at)}` : '';
    return {
      ...base,
      kind: 'granted',
      key: `${lease.id}:granted`,
      slot: `${lease.id}:granted`,
      level: 'success',
      title: `GPU granted${where ? `: ${where}` : ''}`,
      text:
        `GPU granted to ${where || `lease ${lease.id}`} after ${formatDuration(waited)} in the queue: ` +
        `${gpusOf(lease)}${until}.`
    };
  }
  const bg = labels.bg;
  if (lease.phase !== 'ended') {
    return null;
  }
  // a lease you released or a request you cancelled yourself: nothing to tell, but for a background cell
  const yours = lease.state === 'released' || lease.state === 'cancelled';
  if (bg && lease.state !== 'cancelled') {
    const finished = lease.state === 'released';
    const inNotebook = notebook ? ` in ${baseName(notebook)}` : '';
    return {
      ...base,
      kind: 'background',
      key: `${lease.id}:ended`,
      level: finished ? 'success' : 'error',
      title: `Background cell ${bg} ${finished ? 'finished' : change}`,
      text: finished
        ? `Background cell ${bg}${inNotebook} finished: lease ${lease.id} ${endedWords(lease)}.`
        : `Background cell ${bg}${inNotebook} stopped: lease ${lease.id} ${endedWords(lease)}.`
    };
  }
  if (!yours) {
    return {
      ...base,
      kind: 'revoked',
      key: `${lease.id}:ended`,
      level: 'error',
      title: `GPU lease ${lease.id} ${change}`,
      text: `Your GPU lease ${lease.id}${where ? ` (${where})` : ''} ${endedWords(lease)}.`
    };
  }
  return null;
}

/**
 * The notice an event about one of your leases gives, or null when it is nothing to tell. `known` is the lease
 * as last fetched, for the notebook and cell of warnings (their events name only the lease).
 */
export function noticeFor(event: IEvent, known?: ILease): INotice | null {
  if (event.type === 'lease') {
    return leaseNotice(event);
  }
  const leaseId = String(event.lease_id ?? '');
  if (!leaseId) {
    return null;
  }
  const deadline = Number(event.deadline ?? 0);
  const where = whereOf(known?.labels);
  const labels = known?.labels ?? {};
  const base = {
    leaseId,
    notebook: labels.notebook || null,
    cell: labels.cell || null,
    cellId: labels.cell_id || null,
    slot: `${leaseId}:warning`,
    level: 'warning' as const
  };
  if (event.type === 'lease.preempting') {
    const at = deadline ? ` at ${formatClock(deadline)}` : ' soon';
    return {
      ...base,
      kind: 'preemption',
      key: `${leaseId}:preempting:${deadline}`,
      title: `GPU lease ${leaseId} will be preempted`,
      text:
        `GPU lease ${leaseId}${where ? ` (${where})` : ''} will be preempted${at} for ` +
        `${event.by_class ? `a request of priority class ${event.by_class}` : 'a higher-priority request'}: save your work.`
    };
  }
  if (event.type === 'warning') {
    const kind = String(event.kind ?? '');
    const what = kind === 'idle' ? 'be revoked for idleness' : 'expire';
    return {
      ...base,
      kind: 'warning',
      key: `${leaseId}:warning:${kind}:${deadline}`,
      warning: kind,
      title: `GPU lease ${leaseId} will ${what}`,
      text: event.message ?? `GPU lease ${leaseId} will ${what} soon`
    };
  }
  return null;
}
