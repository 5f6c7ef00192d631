/** What a GPU is and what a lease used, in the words of the cards (pure functions of the broker's views). */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { leaseUsage, showsIdleCountdown, suspendWords } from '../src/cards';
import { gpuKind, wants } from '../src/gputype';
import { ILease } from '../src/leaseView';

const GiB = 2 ** 30;

test('a GPU card says its memory and whether it is a MIG slice', () => {
  assert.ok(gpuKind({ memory_total: 80 * GiB }).includes('80 GiB'));
  assert.ok(!gpuKind({ memory_total: 80 * GiB }).includes('MIG'));
  assert.ok(gpuKind({ memory_total: 10 * GiB, mig: true }).includes('MIG'));
});

test('a queued request names the GPU type and size it waits for, nothing for any GPU', () => {
  assert.equal(wants({}), '');
  const w = wants({ gpu_type: 'H100', gpu_mem: 40 * GiB });
  assert.ok(w.includes('H100') && w.includes('40 GiB'));
});

test('the idle countdown shows only while no cell runs on the lease', () => {
  const lease = (fields: Partial<ILease>) => ({ idle_deadline: null, pids: [], ...fields }) as ILease;
  assert.equal(showsIdleCountdown(lease({ idle_deadline: 100 })), true);
  assert.equal(showsIdleCountdown(lease({ idle_deadline: 100, pids: [42] })), false);
  assert.equal(showsIdleCountdown(lease({})), false);
});

test("a lease's usage: its peak of what it held and its utilisation, nothing before a sample", () => {
  assert.equal(leaseUsage(null), '');
  const before = { samples: 0, peak_memory: null, held_memory: 0, mean_utilization: null, peak_utilization: null, source: null };
  assert.equal(leaseUsage(before), '');
  const used = leaseUsage({ ...before, samples: 3, peak_memory: 3 * GiB, held_memory: 40 * GiB, mean_utilization: 61.6, peak_utilization: 94, source: 'process' });
  assert.ok(used.includes('3.0 GiB') && used.includes('40 GiB') && used.includes('62%') && used.includes('94%'), used);
});

test("a suspended lease, or one asked to suspend, shows the broker's words as they come", () => {
  const lease = (fields: Partial<ILease>) => ({ phase: 'holding', suspend: null, suspended: null, ...fields }) as ILease;
  const text = 'suspended since 14:05 (idle); resumes with its next cell';
  const suspended = { why: 'idle', since: 1, resume: false, devices: ['GPU-a'], model: 'H100', how: 'stop', text };
  assert.deepEqual(suspendWords(lease({ phase: 'suspended', suspended } as Partial<ILease>)), [text]);
  const ask = { why: 'idle' as const, deadline: 2, text: 'asked to suspend by 14:06 (idle)' };
  assert.deepEqual(suspendWords(lease({ suspend: ask })), [ask.text]);
  assert.deepEqual(suspendWords(lease({})), []);
});
