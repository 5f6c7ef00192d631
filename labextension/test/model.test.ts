/** The sidebar's model, without a server: broker time and the queue's waits counted locally between fetches. */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { IQueueEntry } from '../src/api';
import { ILease } from '../src/leaseView';
import { GpuLeaseModel } from '../src/model';

test("broker time is local time corrected by the last fetch's skew", () => {
  const m = new GpuLeaseModel();
  m.skew = 3600;
  assert.ok(Math.abs(m.now() - (Date.now() / 1000 + 3600)) < 5);
});

test('a queued entry has waited what the broker said, plus the time since the fetch', () => {
  const m = new GpuLeaseModel();
  m.queueFetchedAt = m.now() - 30;
  const waited = m.waited({ waited_seconds: 100 } as IQueueEntry);
  assert.ok(waited >= 130 && waited < 135, String(waited));
  m.queueFetchedAt = m.now() + 30; // a fetch "after" now (clock skew moved): never counts backwards
  assert.equal(m.waited({ waited_seconds: 100 } as IQueueEntry), 100);
});

test('yours: a lease of the signed-in user, nobody before the first fetch', () => {
  const m = new GpuLeaseModel();
  const lease = { user: 'alice' } as ILease;
  assert.equal(m.isMine(lease), false);
  assert.equal(m.isAdmin, false);
  m.info = { simulated: true, time: 0, user: { name: 'alice', uid: null, admin: true }, summary: { total: 1, free: 1, states: {}, queued: 0, simulated: true } };
  assert.equal(m.isMine(lease), true);
  assert.equal(m.isMine({ user: 'bob' } as ILease), false);
  assert.equal(m.isAdmin, true);
});
