// The dashboard: reads /stats once a second and draws what moved since the last reading.
// /stats holds cumulative counters only; rates and interval percentiles are worked out here.
'use strict';
const $ = (id) => document.getElementById(id);
const POINTS = 60;
const COLORS = ['#4fb3ff', '#5fd38d', '#ffb454', '#ff6b6b', '#c792ea', '#89ddff'];
const history = { sessions: [], slots: [], capacity: [], steps: [], batch: [], p50: [], p99: [], late: [], stages: {} };
const board = window.dashboard = { readings: 0, last: null, current: {}, error: null };
let previous = null;

function push(list, v) { list.push(v); if (list.length > POINTS) list.shift(); }

// The value below which fraction q of the lags recorded between two readings fall (bucket edge).
function intervalPercentile(edges, now, before, count, q) {
  if (count <= 0) return 0;
  const want = q * count;
  for (let i = 0; i < edges.length; i++) if (now[i] - before[i] >= want) return edges[i];
  return edges[edges.length - 1];
}

function rows(table, entries) {
  table.innerHTML = entries.length ? '' : '<tr><td>none</td><td></td></tr>';
  for (const [name, value] of entries) {
    const tr = table.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = value.toLocaleString();
  }
}

function megabytes(bytes) { return `${(bytes / 2 ** 20).toFixed(bytes < 2 ** 20 ? 2 : 1)} MB`; }

// The prompt cache of a model that takes a persona (PersonaPlex); hidden for one that takes none.
function promptCache(persona) {
  const cache = persona && persona.prompt_cache;
  $('promptcache').hidden = !cache;
  if (!cache) return;
  const asked = cache.hits + cache.misses;
  board.promptCache = { ...cache, hitRate: asked ? cache.hits / asked : null };
  rows($('cache'), [
    ['hits', cache.hits], ['misses', cache.misses],
    ['hit rate', asked ? `${(100 * cache.hits / asked).toFixed(1)} %` : '–'],
    ['bytes of max', `${megabytes(cache.bytes)} of ${megabytes(cache.max_bytes)}`],
    ['entries', cache.entries], ['evictions', cache.evictions], ['prefills', cache.prefills],
  ]);
}

async function tick() {
  let s;
  try {
    const response = await fetch('/stats', { cache: 'no-store' });
    if (!response.ok) throw new Error(`/stats answered ${response.status}`);
    s = await response.json();
    board.error = null; $('message').hidden = true;
  } catch (e) {
    board.error = e.message;
    $('message').hidden = false; $('message').className = 'message error';
    $('message').textContent = `Cannot read /stats: ${e.message}`;
    return;
  }
  $('info').textContent = `backend ${s.backend} · ${s.sample_rate} Hz · frame ${s.frame_ms.toFixed(0)} ms` +
    (s.ready ? '' : ' · not ready');
  const cur = { sessions: s.sessions_active, slots: s.slots, admitted: s.admitted };
  if (previous) {
    const dt = Math.max(s.time - previous.time, 1e-3);
    const steps = s.steps - previous.steps;
    cur.stepsPerSecond = steps / dt;
    cur.batch = steps > 0 ? (s.frames - previous.frames) / steps : 0;
    const stepCount = s.step.count - previous.step.count;
    cur.stepMs = stepCount > 0 ? (s.step.total_ms - previous.step.total_ms) / stepCount : 0;
    const h = s.lag_histogram, ph = previous.lag_histogram;
    const n = h.count - ph.count;
    cur.p50 = intervalPercentile(h.edges_ms, h.cumulative, ph.cumulative, n, 0.5);
    cur.p99 = intervalPercentile(h.edges_ms, h.cumulative, ph.cumulative, n, 0.99);
    cur.latePerSecond = (s.late_frames - previous.late_frames) / dt;
    push(history.steps, cur.stepsPerSecond); push(history.batch, cur.batch);
    push(history.p50, cur.p50); push(history.p99, cur.p99); push(history.late, cur.latePerSecond);
    for (const [name, stage] of Object.entries(s.stages)) {
      const before = previous.stages[name] || { count: 0, total_ms: 0 };
      const c = stage.count - before.count;
      push(history.stages[name] = history.stages[name] || [], c > 0 ? (stage.total_ms - before.total_ms) / c : 0);
    }
    if (!Object.keys(s.stages).length) push(history.stages.step = history.stages.step || [], cur.stepMs);
  }
  push(history.sessions, s.sessions_active); push(history.slots, s.slots); push(history.capacity, s.capacity);
  previous = s; board.last = s; board.current = cur; board.readings++;

  $('sessions').innerHTML = `${s.sessions_active}<small> / ${s.capacity} / ${s.slots}</small>`;
  $('steps').textContent = cur.stepsPerSecond === undefined ? '–' : cur.stepsPerSecond.toFixed(1);
  $('batch').textContent = cur.batch === undefined ? '–' : cur.batch.toFixed(2);
  $('steptime').innerHTML = cur.stepMs === undefined ? '–' : `${cur.stepMs.toFixed(2)}<small> ms</small>`;
  $('lag').innerHTML = cur.p50 === undefined ? '–'
    : `${cur.p50.toFixed(1)}<small> / </small>${cur.p99.toFixed(1)}<small> ms</small>`;
  $('late').textContent = s.late_frames.toLocaleString();
  $('opened').textContent = s.sessions_opened.toLocaleString();
  $('refusedtotal').textContent = Object.values(s.refused).reduce((a, b) => a + b, 0).toLocaleString();
  rows($('handoffs'), Object.entries(s.handoffs));
  rows($('refused'), Object.entries(s.refused));
  promptCache(s.persona);

  const o = { points: POINTS };
  drawChart($('c-sessions'), [{ values: history.sessions, color: COLORS[0], label: 'active' },
    { values: history.capacity, color: COLORS[3], label: 'capacity' },
    { values: history.slots, color: '#3a4755', label: 'slots' }], o);
  drawChart($('c-steps'), [{ values: history.steps, color: COLORS[1], label: 'steps/s' }], o);
  drawChart($('c-batch'), [{ values: history.batch, color: COLORS[2], label: 'mean' }], o);
  drawChart($('c-lag'), [{ values: history.p50, color: COLORS[0], label: 'p50' },
    { values: history.p99, color: COLORS[3], label: 'p99' }], o);
  drawChart($('c-stages'), Object.entries(history.stages).map(([name, values], i) =>
    ({ values, color: COLORS[i % COLORS.length], label: name })), o);
  drawChart($('c-late'), [{ values: history.late, color: COLORS[3], label: 'late/s' }], o);
}

tick();
setInterval(tick, 1000);
