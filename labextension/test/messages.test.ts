/** The notices about your own leases: from the broker's view (phase, reason_text), never from state names. */
process.env.TZ = 'UTC';

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { ILease } from '../src/leaseView';
import { baseName, endedWords, labPath, noticeFor, whereOf } from '../src/messages';

const LABELS: Record<string, string> = { cell: 'gpu In[3]', notebook: '/home/u/second.ipynb' };

function view(fields: Partial<ILease>): ILease {
  return { id: 'L1', user: 'u', state: 'active', phase: 'holding', reason: '', created_at: 1000, granted_at: 1000,
    expires_at: null, devices: [], labels: LABELS, reason_text: null, ...fields } as ILease;
}

function ended(state: ILease['state'], reason: string, reasonText: string | null, labels = LABELS) {
  const lease = view({ state, phase: 'ended', reason, reason_text: reasonText, labels });
  return { schema: 'x', type: 'lease', change: state, previous: 'active', lease };
}

test("an ended lease is told in the broker's sentence, not its code", () => {
  const notice = noticeFor(ended('revoked', 'idle_pressure', 'revoked: idle for 10 min while others waited'));
  assert.ok(notice);
  assert.equal(notice.kind, 'revoked');
  assert.equal(notice.level, 'error');
  assert.ok(notice.text.includes('revoked: idle for 10 min while others waited'));
  assert.ok(notice.text.includes('second.ipynb, cell In[3]'));
  assert.ok(!notice.text.includes('idle_pressure'));
  const gone = noticeFor(ended('revoked', 'holder_gone', null));
  assert.ok(gone && !gone.text.includes('holder_gone') && gone.text.includes('revoked'));
  const exited = noticeFor(ended('revoked', 'holder_exited', 'ended: the process that held it exited'));
  assert.ok(exited && !/was ended/.test(exited.text) && exited.text.includes('ended: the process that held it exited'));
});

test('a lease you ended yourself is not told, but a background cell that finished is', () => {
  assert.equal(noticeFor(ended('released', 'released', 'released')), null);
  assert.equal(noticeFor(ended('cancelled', 'cancelled', 'cancelled')), null);
  const bg = noticeFor(ended('released', 'cell finished', 'released: cell finished', { ...LABELS, bg: 'train' }));
  assert.ok(bg);
  assert.equal(bg.kind, 'background');
  assert.equal(bg.level, 'success');
  assert.ok(bg.title.includes('train') && bg.title.includes('finished'));
  assert.ok(bg.text.includes('released: cell finished'));
  const failed = noticeFor(ended('expired', 'expired', 'expired: its time limit ran out', { ...LABELS, bg: 'train' }));
  assert.ok(failed && failed.level === 'error' && failed.text.includes('its time limit ran out'));
});

test('a lease that still holds its GPUs or waits is told nothing but a grant after a wait', () => {
  const renewed = { schema: 'x', type: 'lease', change: 'renewed', previous: 'active', lease: view({}) };
  assert.equal(noticeFor(renewed), null);
  const quick = { schema: 'x', type: 'lease', change: 'granted', previous: 'queued', lease: view({ granted_at: 1000.2 }) };
  assert.equal(noticeFor(quick), null);
  const waited = view({ granted_at: 1000 + 125, expires_at: 1000 + 125 + 3600 });
  const grant = noticeFor({ schema: 'x', type: 'lease', change: 'granted', previous: 'queued', lease: waited });
  assert.ok(grant);
  assert.equal(grant.kind, 'granted');
  assert.ok(grant.text.includes('2 min'), grant.text);
  assert.match(grant.text, /until (.* )?01:18\./);
});

test('warnings name the deadline and are keyed by it', () => {
  const known = view({});
  const preempt = noticeFor({ schema: 'x', type: 'lease.preempting', lease_id: 'L1', deadline: 7200, by_class: 'urgent' }, known);
  assert.ok(preempt);
  assert.equal(preempt.kind, 'preemption');
  assert.ok(preempt.text.includes('02:00') && preempt.text.includes('urgent'));
  assert.equal(preempt.notebook, LABELS.notebook);
  const idle = noticeFor({ schema: 'x', type: 'warning', lease_id: 'L1', kind: 'idle', deadline: 60, message: 'idle soon' });
  assert.ok(idle && idle.warning === 'idle' && idle.text === 'idle soon' && idle.key.includes('60'));
  assert.equal(noticeFor({ schema: 'x', type: 'warning' }), null);
});

test('where a lease runs, from its labels', () => {
  assert.equal(baseName('work/second.ipynb'), 'second.ipynb');
  assert.equal(whereOf(LABELS), 'second.ipynb, cell In[3]');
  assert.equal(whereOf(undefined), '');
  assert.equal(endedWords({ state: 'failed', reason_text: null }), 'was failed');
  assert.equal(labPath('/srv/root/a/b.ipynb', '/srv/root/', []), 'a/b.ipynb');
  assert.equal(labPath('/other/place/a/b.ipynb', '/srv/root', ['b.ipynb', 'a/b.ipynb']), 'a/b.ipynb');
  assert.equal(labPath('/elsewhere/x.ipynb', '/srv/root', []), null);
  assert.equal(labPath('rel/x.ipynb', '/srv/root', []), 'rel/x.ipynb');
});
