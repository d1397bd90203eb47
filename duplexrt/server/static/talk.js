// The talk page: microphone -> /v1/duplex (raw PCM f32 at the model's rate) -> speakers.
//
// Why /v1/duplex and not /api/chat: the page already holds PCM (the AudioWorklet gives float
// samples), browsers have no Opus encoder reachable from an AudioWorklet without shipping one,
// and on loopback or a LAN the bandwidth of f32 PCM (96 KB/s at 24 kHz) costs nothing.  No codec
// also means no codec delay in the lag the page measures.
'use strict';
const $ = (id) => document.getElementById(id);
const KEY_PROTOCOL = 'openai-insecure-api-key.';
const AUDIO_START_MS = 5000;
// A request head holds at most 64 KiB (server/head_limits.py): room for the URL and the headers.
const MAX_URL_BYTES = 48 * 1024;
// What a role prompt has no use for, as the model's check refuses it (backends/moshi/persona.py):
// control characters other than tab and newlines, unassigned code points, surrogates, private use.
const NOT_TEXT = /[^\P{Cc}\t\n\r]|\p{Cn}|\p{Cs}|\p{Co}/u;

// Everything the page measures, also read by the browser tests.
const talk = window.duplexrt = {
  state: 'idle', error: null, server: null,
  sentMessages: 0, sentSamples: 0, receivedMessages: 0, receivedSamples: 0, receivedPeak: 0,
  playedSamples: 0, playedPeak: 0, late: 0, dropped: 0, bufferMs: 0,
  ttfaMs: null, lagMs: null, text: '', textPieces: 0, end: null,
  // What the caller said, from the server's transcriber (/v1/duplex "input_text"); the server's
  // transcriber (/stats "transcriber": its model), null when it has none.
  callerText: '', callerPieces: 0, transcriber: null,
  // A model that takes a persona: what the server offers (/stats "persona"), what this call asked
  // for, and what session.created said is in effect.  All null for a model that takes none.
  personaOffer: null, personaAsked: null, persona: null,
};
let ws = null, ctx = null, node = null, mic = null;
let firstSentAt = null, sendLog = [];   // [cumulative samples sent, time] per message, for the lag
const lagHistory = [];

function show(text, kind) {
  const m = $('message');
  m.textContent = text;
  m.className = 'message' + (kind ? ' ' + kind : '');
}
function fail(text) { talk.error = text; show(text, 'error'); }

async function serverInfo() {
  const response = await fetch('/stats', { cache: 'no-store' });
  if (!response.ok) {
    const error = new Error(`/stats answered ${response.status}`);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

// What the page says when /stats cannot be had (``e``: serverInfo's error).
function unreachable(e) {
  if (e && e.status === 429) {
    return 'The server refused this browser: too many connections from your address at once (429). ' +
           'Close other tabs of this page, or wait a moment, and press Start again.';
  }
  return `Cannot reach the server: ${e ? e.message : 'no answer'}.`;
}
const DRAINING = 'The server is draining (shutting down): it takes no new calls. Try again once it is back, or use another server.';

async function init() {
  try {
    const s = talk.server = await serverInfo();
    showServer(s);
    if (s.api_key_required) {
      $('keyrow').hidden = false;
      $('key').value = sessionStorage.getItem('duplexrt-key') || '';
      show('This server needs an API key: enter it, then press “Start talking”.');
    }
  } catch (e) {
    fail(unreachable(e));
  }
}

function showServer(s) {
  $('info').textContent = `backend ${s.backend} · ${s.sample_rate} Hz · ${s.admitted}/${s.slots} slots in use` +
    (s.draining ? ' · draining: no new calls' : '');
  offerPersona(s.persona);
  offerTranscript(s.transcriber);
}

// The caller's words beside the model's, once the server says it transcribes its callers.
function offerTranscript(transcriber) {
  if (!transcriber || talk.transcriber) return;
  talk.transcriber = transcriber;
  $('callerhead').textContent = `Your words (${transcriber.model}, a moment behind)`;
  $('callerpanel').hidden = false;
  $('texts').classList.add('both');
}
// No answer: no slot count (the last one would be stale).
function serverLost(e) {
  $('info').textContent = e && e.status ? `the server answered ${e.status}` : 'the server cannot be reached';
}
function refreshServer() { return serverInfo().then(showServer, serverLost); }

// -- the persona (a model that takes one: PersonaPlex) ---------------------------------------------

// The persona box, once the server says its model takes a persona; nothing at all otherwise.
function offerPersona(offer) {
  if (!offer || talk.personaOffer) return;   // none, or offered already (the voices do not change)
  talk.personaOffer = offer;
  const menu = $('voice');
  for (const name of offer.voices || []) menu.add(new Option(name, name, false, name === offer.default_voice));
  $('instructions').value = offer.default_instructions || '';
  $('instructions').oninput = personaHint;
  $('persona').hidden = false;
  personaHint();
}

function personaText() { return $('instructions').value; }

// Characters typed, the model's limit (in tokens: the server counts them, the page cannot), and
// the tokens the last call's prompt took.
function personaHint() {
  const offer = talk.personaOffer, text = personaText(), hint = $('prompthint');
  const parts = [`${[...text].length} characters`];
  if (!text.trim()) parts.push('empty: the default prompt');
  if (offer.max_prompt_tokens) parts.push(`at most ${offer.max_prompt_tokens} tokens with the system tags`);
  if (talk.persona && talk.persona.prompt_tokens !== undefined) parts.push(`last call: ${talk.persona.prompt_tokens} tokens`);
  const problem = personaProblem();
  hint.textContent = problem || parts.join(' · ');
  hint.className = 'hint' + (problem ? ' warn' : '');
}

// What the page can tell is wrong with the prompt before sending it, or null.
function personaProblem() {
  const text = personaText(), bad = NOT_TEXT.exec(text);
  if (bad) {
    const code = bad[0].codePointAt(0).toString(16).toUpperCase().padStart(4, '0');
    return `The prompt holds a character that is not text (U+${code} at ${bad.index}): remove it.`;
  }
  if (personaQuery().length > MAX_URL_BYTES) return 'The prompt is too long to send: shorten it.';
  return null;
}

// The query parameters of the persona asked for ('' for a model that takes none).
function personaQuery() {
  if (!talk.personaOffer) return '';
  return `&instructions=${encodeURIComponent(personaText())}&voice=${encodeURIComponent($('voice').value)}`;
}

function lockPersona(locked) {
  $('instructions').disabled = locked;
  $('voice').disabled = locked;
}

async function start() {
  $('start').disabled = true;
  lockPersona(true);
  Object.assign(talk, { state: 'starting', error: null, sentMessages: 0, sentSamples: 0, receivedMessages: 0,
    receivedSamples: 0, receivedPeak: 0, ttfaMs: null, lagMs: null, text: '', textPieces: 0, end: null,
    personaAsked: null, persona: null, callerText: '', callerPieces: 0 });
  $('text').textContent = '';
  $('callertext').textContent = '';
  firstSentAt = null; sendLog = []; lagHistory.length = 0;
  try {
    talk.server = await serverInfo();
  } catch (e) { serverLost(e); fail(unreachable(e)); return reset(); }
  showServer(talk.server);
  if (talk.server.draining) { fail(DRAINING); return reset(); }
  const key = $('key').value.trim();
  if (talk.server.api_key_required && !key) { fail('This server needs an API key: enter it first.'); return reset(); }
  if (talk.server.free_slots <= 0) {
    fail(`The server is full: all ${talk.server.slots} session slots are in use. Try again in a moment.`);
    return reset();
  }
  if (talk.personaOffer) {
    const problem = personaProblem();
    if (problem) { fail(problem); return reset(); }
    talk.personaAsked = { instructions: personaText(), voice: $('voice').value };
  }
  if (key) sessionStorage.setItem('duplexrt-key', key);
  if (!window.isSecureContext || !navigator.mediaDevices || !window.AudioWorkletNode) {
    // Browsers give the microphone and AudioWorklets only to https:// pages and to localhost.
    const port = location.port || (location.protocol === 'https:' ? '443' : '80');
    fail(`This browser gives the microphone only to https:// pages or to localhost, and this page is ${location.origin}. ` +
         `Start the server with TLS (duplexrt serve --ssl-certfile cert.pem --ssl-keyfile key.pem) and open ` +
         `https://${location.host}/, or open http://127.0.0.1:${port}/ on the server machine (from here, through ` +
         `an SSH tunnel: ssh -L ${port}:127.0.0.1:${port} ${location.hostname}).`);
    return reset();
  }
  try {
    mic = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  } catch (e) {
    fail(e.name === 'NotAllowedError' || e.name === 'SecurityError'
      ? 'Microphone access was denied. Allow it for this page (the icon in the address bar) and press Start again.'
      : e.name === 'NotFoundError' ? 'No microphone was found.'
      : `The microphone could not be opened: ${e.message}`);
    return reset();
  }
  try {
    ctx = new AudioContext({ latencyHint: 'interactive' });
    await ctx.audioWorklet.addModule('/static/worklet.js');
    node = new AudioWorkletNode(ctx, 'duplexrt-audio', { numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [2],
      // The server sends whole model frames: the buffer must ride out one frame's gap, plus jitter.
      processorOptions: { modelRate: talk.server.sample_rate, targetMs: talk.server.frame_ms + 40,
                          maxMs: 3 * talk.server.frame_ms + 200 } });
    node.port.onmessage = onWorklet;
    ctx.createMediaStreamSource(mic).connect(node);
    node.connect(ctx.destination);
    // Firefox with no sound device leaves resume() pending for ever (no error): give up after a while.
    const started = await Promise.race([ctx.resume().then(() => true),
                                        new Promise((ok) => setTimeout(() => ok(false), AUDIO_START_MS))]);
    if (!started) throw new Error(`no audio output after ${AUDIO_START_MS / 1000} s: is a speaker or headphones connected?`);
  } catch (e) {
    fail(`The browser could not start audio (${e.message}).`);
    return teardown();
  }
  connect(key);
}

function connect(key) {
  const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
  const url = `${scheme}://${location.host}/v1/duplex?format=pcm_f32le&rate=${talk.server.sample_rate}` +
    personaQuery();
  // The key rides in a subprotocol (browsers cannot set Authorization), never in the URL.
  try {
    ws = key ? new WebSocket(url, ['duplexrt', KEY_PROTOCOL + key]) : new WebSocket(url);
  } catch (e) {   // a SyntaxError: the key has characters a subprotocol cannot carry
    fail(`This key cannot be sent from a browser (${e.message}).`);
    return teardown();
  }
  ws.binaryType = 'arraybuffer';
  let opened = false;
  ws.onopen = () => {
    opened = true; talk.state = 'talking';
    $('stop').disabled = false;
    show('Connected: talk now.', 'ok');
    node.port.postMessage({ type: 'send', on: true });
  };
  ws.onmessage = (e) => (typeof e.data === 'string' ? onControl(JSON.parse(e.data)) : onAudio(e.data));
  ws.onclose = async (e) => {
    node && node.port.postMessage({ type: 'send', on: false });
    if (!opened) await explainRefusal(key);
    else if (talk.state === 'talking') {
      const why = e.reason ? `: ${e.reason}` : '';
      if (e.code === 1001 || (talk.end && talk.end.reason === 'shutdown')) {
        fail(`The server is shutting down (draining) and ended the call${why}. Press Start to call again once it takes calls.`);
      } else if (e.code === 1000) show(`The session ended${why}.`);
      else if (e.code === 1006) {
        fail('The connection to the server was cut (no goodbye from the server: the network dropped, or the ' +
             'server stopped). Press Start to call again.');
      } else fail(`The server closed the connection (code ${e.code}${why}).`);
    }
    refreshServer();   // the slot count as it is now, or none once the server is gone
    teardown();
  };
}

// The refusals /stats counts that the page can name.
const NAMED_REFUSALS = ['shutting_down', 'too_many_from_peer', 'bad_persona', 'at_capacity', 'no_free_slot',
                        'foreign_origin'];
// A busy server answers /stats with a page up to a second old (its render budget): a refusal
// counted since is asked about again once that page must have been renewed.
const STATS_MAX_AGE_MS = 1000;

async function explainRefusal(key) {
  // A browser hides the HTTP status of a refused WebSocket: ask the server why it would refuse.
  let s = null, error = null;
  // A refusal the server counted since this call began (its /stats "refused", by reason).
  const count = (info, reason) => (info && info.refused && info.refused[reason]) || 0;
  const named = (info) => NAMED_REFUSALS.some((reason) => count(info, reason) > count(talk.server, reason));
  try { s = await serverInfo(); } catch (e) { error = e; }
  if (s && !named(s) && !s.draining) {
    await new Promise((ok) => setTimeout(ok, STATS_MAX_AGE_MS + 100));
    try { s = await serverInfo(); } catch (e) { s = null; error = e; }
  }
  const grew = (reason) => count(s, reason) > count(talk.server, reason);
  if (!s) fail(error && error.status === 429 ? unreachable(error) : 'The server could not be reached.');
  else if (s.draining || grew('shutting_down')) fail(DRAINING);
  else if (grew('too_many_from_peer')) fail(unreachable({ status: 429 }));
  else if (talk.personaAsked && grew('bad_persona')) {
    // The server says why in its 400, which a browser does not show: the page can only name the
    // likely causes (the page checked the characters and the voice is from the server's list).
    const limit = talk.personaOffer.max_prompt_tokens;
    fail('The server refused the persona (voice and instructions): most likely the instructions are too long' +
         (limit ? ` (at most ${limit} tokens)` : '') + '. Shorten them and press Start again.');
  } else if (s.free_slots <= 0 || grew('at_capacity') || grew('no_free_slot')) {
    fail(`The server is full (503): all ${s.slots} session slots are in use. Try again in a moment.`);
  } else if (grew('foreign_origin')) fail('The server refused this page (403): its origin is not one it accepts.');
  else if (s.api_key_required) fail(key ? 'The server refused the API key: check it and try again.'
    : 'This server needs an API key: enter it first.');
  else if (!s.ready) fail('The server is not ready (the model is loading, or it is shutting down).');
  else fail('The server refused the connection.');
}

function onControl(m) {
  if (m.type === 'text') {
    talk.text += m.text; talk.textPieces++;
    $('text').textContent = talk.text;
  } else if (m.type === 'input_text') {
    // The transcriber's piece: its text lags the caller's audio by the model's delay.
    talk.callerText += m.text; talk.callerPieces++;
    $('callertext').textContent = talk.callerText;
  } else if (m.type === 'session.created') {
    talk.persona = m.persona || null;
    if (talk.persona) {
      show(`Connected as voice ${talk.persona.voice} (a role prompt of ${talk.persona.prompt_tokens} tokens): talk now.`, 'ok');
      personaHint();
    }
  } else if (m.type === 'error') {
    if (/persona/.test(m.code || '')) fail(`The server refused the persona: ${m.message}`);
    else fail(`The server reported: ${m.message}`);
  } else if (m.type === 'session.end') {
    talk.end = m;
    if (m.reason !== 'client_end' && m.reason !== 'input_end' && m.error) fail(`The session ended: ${m.error.message || m.reason}`);
  }
}

function onAudio(buffer) {
  const samples = new Float32Array(buffer);
  const now = performance.now();
  talk.receivedMessages++;
  if (talk.ttfaMs === null && firstSentAt !== null) talk.ttfaMs = now - firstSentAt;
  talk.receivedSamples += samples.length;
  for (let i = 0; i < samples.length; i++) {
    const v = Math.abs(samples[i]); if (v > talk.receivedPeak) talk.receivedPeak = v;
  }
  // A duplex model answers sample for sample: the sample just received left as sample N.
  while (sendLog.length > 1 && sendLog[1][0] <= talk.receivedSamples) sendLog.shift();
  if (sendLog.length && sendLog[0][0] <= talk.receivedSamples) talk.lagMs = now - sendLog[0][1];
  node.port.postMessage({ type: 'play', samples }, [samples.buffer]);
}

function onWorklet(e) {
  const m = e.data;
  if (m.type === 'mic') {
    if (!ws || ws.readyState !== WebSocket.OPEN) return;
    const now = performance.now();
    if (firstSentAt === null) firstSentAt = now;
    ws.send(m.samples.buffer);
    talk.sentMessages++; talk.sentSamples += m.samples.length;
    sendLog.push([talk.sentSamples, now]);
    if (sendLog.length > 2000) sendLog.shift();
  } else if (m.type === 'stats') {
    talk.bufferMs = m.bufferMs; talk.late = m.late; talk.dropped = m.dropped;
    talk.playedSamples = m.played; talk.playedPeak = m.peak; talk.audioBlocks = m.blocks;
  }
}

function stop() {
  $('stop').disabled = true;
  if (ws && ws.readyState === WebSocket.OPEN) {
    talk.state = 'stopping';
    node.port.postMessage({ type: 'send', on: false });
    ws.send(JSON.stringify({ type: 'input.end' }));
    show('Stopped.');
    setTimeout(() => ws && ws.close(1000), 1500);
  } else teardown();
}

function teardown() {
  if (mic) mic.getTracks().forEach((t) => t.stop());
  if (ctx) ctx.close();
  ws = null; ctx = null; node = null; mic = null;
  reset();
}
function reset() {
  talk.state = talk.error ? 'failed' : 'idle';
  $('start').disabled = false; $('stop').disabled = true;
  lockPersona(false);
}

function ms(v) { return v === null ? '–' : `${v.toFixed(0)}<small> ms</small>`; }
setInterval(() => {
  $('ttfa').innerHTML = ms(talk.ttfaMs);
  $('lag').innerHTML = ms(talk.lagMs);
  $('late').textContent = String(talk.late);
  $('buffer').innerHTML = ms(talk.bufferMs);
  const rate = (talk.server && talk.server.sample_rate) || 24000;
  $('sent').innerHTML = `${(talk.sentSamples / rate).toFixed(1)}<small> s</small>`;
  $('received').innerHTML = `${(talk.receivedSamples / rate).toFixed(1)}<small> s</small>`;
  $('level').style.width = `${Math.min(100, talk.playedPeak * 100)}%`;
}, 200);
setInterval(() => {
  if (talk.state !== 'talking') return;
  lagHistory.push(talk.lagMs || 0); if (lagHistory.length > 60) lagHistory.shift();
  drawChart($('lagchart'), [{ values: lagHistory, color: '#4fb3ff', label: 'lag' }]);
}, 1000);

setInterval(refreshServer, 2000);   // slots in use, in the header (none while the server cannot be reached)

$('start').onclick = start;
$('stop').onclick = stop;
init();
