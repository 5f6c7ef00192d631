/** The sidebar's text rules against the one contract every client meets (gpulease_protocol/text_cases.json). */
process.env.TZ = 'UTC';

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { formatBytes, formatClock, formatDuration, gpusWanted, parseDuration, plural, waitWords } from '../src/format';

// lib-test/test/format.test.js: the repository root is three folders up
const CASES = JSON.parse(readFileSync(join(__dirname, '..', '..', '..', 'gpulease_protocol', 'text_cases.json'), 'utf8'));

test('parseDuration reads every duration of the contract', () => {
  for (const [text, seconds] of CASES.parse_duration as [string, number][]) {
    assert.equal(parseDuration(text), seconds, text);
  }
});

test('parseDuration refuses every non-duration of the contract', () => {
  for (const text of CASES.parse_duration_invalid as string[]) {
    assert.equal(parseDuration(text), null, text);
  }
  assert.equal(parseDuration('99999d'), null, 'more than ten years');
});

test('formatDuration writes every span of the contract', () => {
  for (const [seconds, text] of CASES.duration_text as [number, string][]) {
    assert.equal(formatDuration(seconds), text, String(seconds));
  }
});

test('formatClock writes every clock time of the contract, in English whatever the locale', () => {
  const now = CASES.clock_text_now as number;
  for (const [epoch, text] of CASES.clock_text as [number, string][]) {
    assert.equal(formatClock(epoch, now), text, String(epoch));
  }
});

test('a formatted duration reads back as about the same span', () => {
  for (const seconds of [45, 600, 5400, 7260]) {
    const back = parseDuration(formatDuration(seconds).replace(/ (min|h|s)\b/g, '$1').replace(/ /g, ''));
    assert.ok(back !== null && Math.abs(back - seconds) < 60, `${seconds} → ${back}`);
  }
});

test('sizes and counts carry their unit and noun', () => {
  assert.equal(formatBytes(0), '0 B');
  assert.match(formatBytes(40 * 2 ** 30), /^40 GiB$/);
  assert.match(formatBytes(1.5 * 2 ** 20), /^1\.5 MiB$/);
  assert.equal(plural(1, 'share'), '1 share');
  assert.equal(plural(3, 'share'), '3 shares');
  assert.equal(gpusWanted({ fraction: 1, min_gpus: 1, max_gpus: 1 }), '1 GPU');
  assert.equal(gpusWanted({ fraction: 1, min_gpus: 2, max_gpus: 2 }), '2 GPUs');
  assert.match(gpusWanted({ fraction: 1, min_gpus: 1, max_gpus: 4 }), /^1.4 GPUs$/);
  assert.equal(gpusWanted({ fraction: 0.25, min_gpus: 1, max_gpus: 1 }), '0.25 GPU');
});

test("a queued request shows the broker's estimate and reason as they come, nothing made up", () => {
  const words = waitWords({ estimate_text: 'in 1–3 min', wait: { text: "GPUs busy: bob's lease ends in 2 min" } });
  assert.equal(words.length, 2);
  assert.ok(words[0].includes('in 1–3 min'));
  assert.equal(words[1], "GPUs busy: bob's lease ends in 2 min");
  assert.deepEqual(waitWords({ estimate_text: null, wait: null }), []);
});

test('days are calendar days across a daylight saving change', () => {
  process.env.TZ = 'Europe/Berlin'; // leaves summer time on Sunday 25 October 2026: a 25-hour day
  try {
    const now = Date.UTC(2026, 9, 24, 21, 30) / 1000; // Saturday 23:30 in Berlin
    assert.equal(formatClock(Date.UTC(2026, 9, 25, 22, 45) / 1000, now), 'tomorrow 23:45');
    assert.equal(formatClock(Date.UTC(2026, 9, 25, 23, 15) / 1000, now), '26 Oct 00:15');
    assert.equal(formatClock(Date.UTC(2026, 9, 23, 21, 45) / 1000, now), 'yesterday 23:45');
  } finally {
    process.env.TZ = 'UTC';
  }
});
