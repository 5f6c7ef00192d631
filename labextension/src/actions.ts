/**
 * What the sidebar's buttons do: confirm where an action would end running work, offer the choices the policy
 * allows, and say in a notification what happened or why it failed.
 */

import { Dialog, InputDialog, Notification, showDialog } from '@jupyterlab/apputils';

import { ILease } from './leaseView';
import { formatClock, formatDuration, parseDuration } from './format';
import { GpuLeaseModel } from './model';

const AUTO_CLOSE_MS = 6000;
const ERROR_CLOSE_MS = 10000;

/** The Extend choices, when the policy leaves room for them. */
export const EXTEND_CHOICES = [15 * 60, 3600].map(seconds => ({ label: `+${formatDuration(seconds)}`, seconds }));
const CUSTOM = 'Custom…';

function gpusOf(l: ILease): string {
  const ids = l.devices.map(d => d.index);
  return ids.length === 1 ? `GPU ${ids[0]}` : `GPUs ${ids.join(', ')}`;
}

/** What runs on a lease, in words, or null when nothing does (no process attached, not active). */
export function runningWork(l: ILease): string | null {
  const attached = (l.pids ?? []).length > 0;
  if (l.state !== 'active' && !attached) {
    return null;
  }
  const labels = l.labels ?? {};
  const notebook = labels.notebook ? labels.notebook.split('/').pop() : '';
  const where = [notebook, labels.cell].filter(Boolean).join(', ');
  const suffix = where ? ` (${where})` : '';
  if (labels.source === '%%gpu' && labels.session) {
    return `The --session ${labels.session} worker holds it${suffix}`;
  }
  if (labels.source === '%%gpu') {
    return `A cell is running on it${suffix}`;
  }
  return attached ? `Processes are attached to it${suffix}` : `It is in use${suffix}`;
}

async function report<T>(work: Promise<T>, done: (result: T) => string, failed: string): Promise<T | null> {
  try {
    const result = await work;
    Notification.success(done(result), { autoClose: AUTO_CLOSE_MS });
    return result;
  } catch (error) {
    Notification.error(`${failed}: ${error instanceof Error ? error.message : error}`, { autoClose: ERROR_CLOSE_MS });
    return null;
  }
}

/** Release a held lease; asks first when a cell (or a session's worker) runs on it. */
export async function releaseLease(model: GpuLeaseModel, l: ILease): Promise<void> {
  const running = runningWork(l);
  if (running) {
    const answer = await showDialog({
      title: `Release lease ${l.id}?`,
      body: `${running}. Releasing stops it and frees ${gpusOf(l)}; the cell ends with a message that you released the lease.`,
      buttons: [Dialog.cancelButton({ label: 'Keep running' }), Dialog.warnButton({ label: 'Release' })]
    });
    if (!answer.button.accept) {
      return;
    }
  }
  await report(
    model.release(l.id),
    () => `Released lease ${l.id}: ${gpusOf(l)} free for others now.`,
    `Could not release lease ${l.id}`
  );
}

/** Withdraw a queued request. */
export async function cancelRequest(model: GpuLeaseModel, l: ILease): Promise<void> {
  const waited = formatDuration(model.now() - l.created_at);
  const where = l.position ? ` (was position ${l.position})` : '';
  await report(
    model.release(l.id),
    ended =>
      ended.state === 'cancelled'
        ? `Cancelled request ${l.id} after ${waited} in the queue${where}.`
        : `Request ${l.id} was granted meanwhile; it is now ${ended.state}.`,
    `Could not cancel request ${l.id}`
  );
}

/** Move a lease's end later: +15 min, +1 h or a custom time, as far as the policy allows. */
export async function extendLease(model: GpuLeaseModel, l: ILease): Promise<void> {
  const now = model.now();
  const end = l.expires_at ?? now;
  const room = l.max_expires_at ? l.max_expires_at - end : Infinity;
  if (room < 60) {
    Notification.warning(
      `Lease ${l.id} cannot be extended: it already ends at ${formatClock(end)}, the longest the policy allows ` +
        'from its grant. Save your work, or request a new lease when it ends.',
      { autoClose: ERROR_CLOSE_MS }
    );
    return;
  }
  const choices = EXTEND_CHOICES.filter(c => c.seconds <= room + 1);
  const most = choices.length ? choices[choices.length - 1].seconds : 0;
  if (Number.isFinite(room) && choices.length < EXTEND_CHOICES.length && room - most >= 60) {
    choices.push({ label: `+${formatDuration(room)} (the limit)`, seconds: room });
  }
  const limit = Number.isFinite(room) ? ` The policy allows up to ${formatClock(end + room)}.` : '';
  const answer = await showDialog({
    title: `Extend lease ${l.id}`,
    body: `It ends at ${formatClock(end)} (in ${formatDuration(end - now)}).${limit}`,
    buttons: [
      Dialog.cancelButton(),
      Dialog.okButton({ label: CUSTOM, displayType: 'default' }),
      ...choices.map(c => Dialog.okButton({ label: c.label }))
    ]
  });
  if (!answer.button.accept) {
    return;
  }
  let seconds = choices.find(c => c.label === answer.button.label)?.seconds ?? null;
  if (seconds === null) {
    seconds = await askDuration(l, room);
    if (seconds === null) {
      return;
    }
  }
  const by = formatDuration(seconds);
  await report(
    model.extend(l, seconds),
    renewed => {
      const at = renewed.expires_at ?? end;
      return `Lease ${l.id} extended by ${by}: it now ends at ${formatClock(at)} (in ${formatDuration(at - model.now())}).`;
    },
    `Could not extend lease ${l.id}`
  );
}

async function askDuration(l: ILease, room: number): Promise<number | null> {
  const most = Number.isFinite(room) ? ` (at most ${formatDuration(room)})` : '';
  const result = await InputDialog.getText({
    title: `Extend lease ${l.id} by…`,
    label: `How much longer${most}? e.g. 30m, 2h, 1h30m`,
    placeholder: '30m',
    okLabel: 'Extend'
  });
  if (!result.button.accept) {
    return null;
  }
  const typed = (result.value ?? '').trim();
  const seconds = parseDuration(typed);
  if (!seconds) {
    Notification.error(`Lease ${l.id} not extended: "${typed}" is not a duration; give e.g. 30m, 2h or 1h30m.`, {
      autoClose: ERROR_CLOSE_MS
    });
    return null;
  }
  if (seconds > room) {
    Notification.error(
      `Lease ${l.id} not extended: ${formatDuration(seconds)} is more than the policy allows; at most ${formatDuration(room)} more.`,
      { autoClose: ERROR_CLOSE_MS }
    );
    return null;
  }
  return seconds;
}

/** Answer an idle warning: mark the lease in use again. */
export async function keepActive(model: GpuLeaseModel, leaseId: string): Promise<void> {
  await report(
    model.keepActive(leaseId),
    kept =>
      kept.idle_deadline
        ? `Lease ${leaseId} marked in use: it is revoked for idleness at ${formatClock(kept.idle_deadline)} at the earliest.`
        : `Lease ${leaseId} marked in use.`,
    `Could not mark lease ${leaseId} in use`
  );
}

/** An admin ends someone's lease, with a reason the user sees. */
export async function revokeLease(model: GpuLeaseModel, l: ILease): Promise<void> {
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
    Notification.error(`Lease ${l.id} not revoked: give a reason, the user sees it.`, { autoClose: ERROR_CLOSE_MS });
    return;
  }
  await report(
    model.revoke(l.id, reason),
    ended => `Revoked lease ${l.id} of ${l.user} (${ended.state === 'cancelled' ? 'its request was cancelled' : gpusOf(l) + ' freed'}).`,
    `Could not revoke lease ${l.id}`
  );
}
