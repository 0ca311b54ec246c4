// The schedule explorer's page: reads the inputs, asks the server (schedules/planner/explore.py) for the
// simulator's figures, and draws them. Nothing here schedules or simulates anything: every number shown is one
// the server sent.
'use strict';

const KINDS = ['F', 'B', 'W', 'BW'];
const KIND_NAMES = {F: 'forward', B: 'backward (inputs)', W: 'backward (weights)', BW: 'backward'};
// as schedules/observe/plot.py: (light, dark) per kind, a rank's even chunks light, odd ones dark
const COLOURS = {F: ['#9ecae1', '#2171b5'], B: ['#fdae6b', '#d94801'], W: ['#a1d99b', '#238b45'],
                 BW: ['#bcbddc', '#6a51a3']};
const IDLE = '#ececec';
const RANK_COLOURS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f',
                      '#bcbd22', '#17becf'];
const SVGNS = 'http://www.w3.org/2000/svg';

const $ = (id) => document.getElementById(id);
const state = {meta: null, mode: 'inputs', runs: [], requests: [], trace: null, chooser: null, profile: null,
               generation: 0, controller: null, pending: false};

// ---------------------------------------------------------------------------------------------------------------
// numbers as shown

function fmt(x, digits = 4) {
  if (x === null || x === undefined || Number.isNaN(x)) return '–';
  return String(+x.toPrecision(digits));
}
function timeText(x, units) {
  return units === 's' ? fmt(x * 1e3) + ' ms' : fmt(x);
}
function memoryText(x, bytes) {
  return bytes ? fmt(x / 1048576, 3) + ' MiB' : fmt(x);  // bytes measured (a profile), else micro-batches
}
function pct(x) { return (100 * x).toFixed(1) + '%'; }
function esc(s) {
  return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;');
}

// ---------------------------------------------------------------------------------------------------------------
// the server

async function api(path, body, signal) {
  const response = await fetch(path, {method: body === undefined ? 'GET' : 'POST', signal,
    headers: {'Content-Type': 'application/json'}, body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

// ---------------------------------------------------------------------------------------------------------------
// inputs

function num(id) { return $(id).value === '' ? null : Number($(id).value); }

function inputs() {
  const fused = $('fused').checked;
  return {p: num('p'), m: num('m'), v: num('v'), F: num('F'), B: num('B'), W: num('W'), BW: num('BW'),
          split: !fused, comm: num('comm') || 0, chained: $('chained').checked, limit: num('limit'),
          schedules: [...document.querySelectorAll('#schedules input:checked')].map((e) => e.value)};
}

function setInputs(values) {
  for (const key of ['p', 'm', 'v', 'F', 'B', 'W', 'comm']) if (key in values) $(key).value = values[key];
  if ('split' in values) $('fused').checked = !values.split;
  if ('chained' in values) $('chained').checked = values.chained;
  if ('schedules' in values) {
    for (const box of document.querySelectorAll('#schedules input')) {
      box.checked = values.schedules === 'all' || values.schedules.includes(box.value);
    }
  }
  showCostFields();
}

function showCostFields() {
  const fused = $('fused').checked;
  $('split-costs').hidden = fused;
  $('fused-cost').hidden = !fused;
}

function simulateRequest(name, inp) {
  return {schedule: name, p: inp.p, m: inp.m, v: inp.v, F: inp.F, B: inp.B, W: inp.W, BW: inp.BW,
          split: inp.split, comm: inp.comm, chained: inp.chained, dependencies: $('arrows').checked};
}

// ---------------------------------------------------------------------------------------------------------------
// asking for the figures: one request per schedule, drawn as they arrive; a newer change drops older answers

let timer = null;
function changed() {
  if (!state.pending) state.changedAt = performance.now();  // the answer's time counts from the first keystroke
  state.pending = true;  // an answer is due (tests wait for it)
  $('preset').value = '';
  $('preset-what').textContent = '';
  clearTimeout(timer);
  timer = setTimeout(state.mode === 'profile' ? rank : update, 40);  // keystrokes close together make one change
}

async function update() {
  const started = state.pending ? state.changedAt : performance.now();
  state.pending = false;
  if (state.mode !== 'inputs') return;
  const generation = ++state.generation;
  if (state.controller) state.controller.abort();
  const controller = state.controller = new AbortController();
  const inp = inputs();
  if (!inp.p || !inp.m) {
    setStatus('error', 'p and m are needed');
    return;
  }
  setStatus('busy', 'simulating…');
  state.requests = inp.schedules.map((name) => simulateRequest(name, inp));
  state.runs = state.requests.map(() => null);
  state.chooser = null;
  renderChooser();
  let failed = null;
  let server = 0;
  await Promise.all(state.requests.map(async (req, i) => {
    try {
      const run = await api('/api/simulate', req, controller.signal);
      if (generation !== state.generation) return;
      server = Math.max(server, run.seconds);
      state.runs[i] = run;
      // draw what has come if the rest keeps the page waiting; a quick answer is drawn once, whole
      if (performance.now() - started > 150) scheduleRender();
    } catch (e) {
      if (e.name !== 'AbortError') failed = e;
    }
  }));
  if (generation !== state.generation) return;
  if (frame !== null) { cancelAnimationFrame(frame); frame = null; }
  const answered = performance.now();
  render();
  const took = performance.now() - started;
  state.lastUpdateMs = took;
  $('timing').textContent = `answered in ${took.toFixed(0)} ms from the change (the slowest simulation ${(server * 1e3).toFixed(0)} ms, ` +
    `drawing ${(performance.now() - answered).toFixed(0)} ms)`;
  $('timing').dataset.ms = took.toFixed(1);
  if (failed) setStatus('error', failed.message);
  else setStatus('ready', 'ready');
}

let frame = null;
function scheduleRender() {
  if (frame === null) frame = requestAnimationFrame(() => { frame = null; render(); });
}

function setStatus(kind, text) {
  $('status').dataset.state = kind;
  $('status').textContent = text;
  $('status').dataset.generation = state.generation;
}

// ---------------------------------------------------------------------------------------------------------------
// the summary table

function summaryRows(runs, limit) {
  const head = ['schedule', 'step T', 'bubble rate (worst rank)', 'idle synced', 'idle interlocked',
                'peak act. mem (rank)', 'peak per rank', 'params / rank'];
  const rows = runs.filter((r) => r).map((run) => {
    const name = esc(run.label || run.schedule);
    if (run.error) {
      return `<tr class="error" data-schedule="${esc(run.schedule)}"><td>${name}</td>` +
        `<td class="text" colspan="7">${esc(run.error)}</td></tr>`;
    }
    const units = run.timeline.units;
    const bytes = run.memory_units === 'bytes';
    const cell = (field, value, text) => `<td data-field="${field}" data-value="${value}">${text}</td>`;
    const over = limit !== null && run.peak_activation_memory > limit;
    const bubble = `1 − ${timeText(run.busy, units)} / ${timeText(run.step, units)} = ${pct(run.bubble)} (${run.bubble_rank})`;
    const closed = run.closed_form ? `<br><span class="closed" title="docs/schedules.md's closed forms at F = B = W">` +
      `closed forms: idle ${esc(run.closed_form[0])}; memory ${esc(run.closed_form[1])}</span>` : '';
    const note = over ? '<br><span class="closed">over the memory limit</span>' : '';
    return `<tr data-schedule="${esc(run.schedule)}" data-label="${esc(run.label)}" class="${over ? 'over' : ''}">` +
      `<td>${name}${closed}${note}</td>` +
      cell('step', run.step, timeText(run.step, units)) +
      cell('bubble', run.bubble, bubble) +
      cell('idle_synced', run.idle_synced, timeText(run.idle_synced, units)) +
      cell('idle_interlocked', run.idle_interlocked, run.chained ? timeText(run.idle_interlocked, units) : '–') +
      cell('peak_activation_memory', run.peak_activation_memory,
           `${memoryText(run.peak_activation_memory, bytes)} (${run.peak_rank})`) +
      cell('peak_per_rank', run.per_rank.map((r) => r.peak_activation_memory).join(' '),
           run.per_rank.map((r) => fmt(bytes ? r.peak_activation_memory / 1048576 : r.peak_activation_memory, 3))
             .join(' ') + (bytes ? ' MiB' : '')) +
      cell('params_per_rank', run.params_per_rank, fmt(run.params_per_rank)) + '</tr>';
  });
  return [head, rows];
}

function renderSummary() {
  const [head, rows] = summaryRows(state.runs, state.mode === 'inputs' ? inputs().limit : null);
  $('summary').tHead.innerHTML = '<tr>' + head.map((h) => `<th>${h}</th>`).join('') + '</tr>';
  $('summary').tBodies[0].innerHTML = rows.join('');
}

// ---------------------------------------------------------------------------------------------------------------
// the figure: one SVG, every run on one time axis

const LEFT = 64, RIGHT = 16;

function rowHeight(p) { return p <= 8 ? 18 : p <= 16 ? 14 : p <= 32 ? 9 : 6; }

function passLabel(q) { return String(q[3]) + (q[6] ? "'" : ''); }

function passColour(q, faded) {
  const colour = COLOURS[KINDS[q[0]]][q[2] % 2];
  if (!faded) return colour;
  // neighbouring steps of a chained run: mixed 70% towards white, as plot.py fades them
  const mix = (i) => Math.round(parseInt(colour.slice(i, i + 2), 16) * 0.3 + 255 * 0.7).toString(16).padStart(2, '0');
  return '#' + mix(1) + mix(3) + mix(5);
}

function ticks(t1, width) {
  const target = Math.max(2, Math.floor(width / 90));
  const raw = t1 / target;
  const pow = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((s) => s * pow).find((s) => s >= raw);
  const out = [];
  for (let t = 0; t <= t1 + 1e-9; t += step) out.push(+t.toPrecision(10));
  return out;
}

// blocks: [{title, run, timeline, overlay (a timeline drawn as outlines over it), memory, deps}]
function drawFigure(blocks, units) {
  const width = Math.max(700, ($('figure').clientWidth || 1100) - 2);
  const t1 = Math.max(1e-12, ...blocks.map((b) => b.span));
  const scale = (width - LEFT - RIGHT) / t1;
  const x = (t) => LEFT + t * scale;
  const parts = [];
  let y = 8;
  const arrows = $('arrows').checked;
  blocks.forEach((block, s) => {
    const ranks = block.timeline.ranks;
    const h = rowHeight(ranks.length);
    parts.push(`<text x="4" y="${y + 12}" font-size="13" font-weight="600" class="block-title" data-block="${s}">` +
               `${esc(block.title)}</text>`);
    y += 20;
    const top = y;
    ranks.forEach((row, r) => {
      const ry = top + r * h;
      parts.push(`<text x="${LEFT - 6}" y="${ry + h * 0.72}" font-size="${Math.min(11, h - 2)}" text-anchor="end" fill="#444">rank ${r}</text>`);
      parts.push(`<rect x="${LEFT}" y="${ry + 1}" width="${(block.span * scale).toFixed(2)}" height="${h - 2}" fill="${IDLE}"/>`);
      // one <rect> per pass, in the rank's order (a row's group says which block and rank; hover finds the pass by
      // its place in the group), then the labels that fit
      const cells = [], labels = [];
      const hy = ry + 1, hh = h - 2;
      row.forEach((q) => {
        const x0 = x(q[4]), w = Math.max(0.5, (q[5] - q[4]) * scale);
        const faded = block.focus !== null && block.focus !== undefined && q[8] !== block.focus;
        cells.push(`<rect x="${x0.toFixed(1)}" y="${hy}" width="${w.toFixed(1)}" height="${hh}" fill="${passColour(q, faded)}"/>`);
        const label = passLabel(q);
        if (w >= 7 * label.length + 2 && h >= 10) {
          labels.push(`<text x="${(x0 + w / 2).toFixed(1)}" y="${ry + h * 0.7}"${faded ? ' fill="#999"' : q[2] % 2 ? ' fill="#fff"' : ''}>${label}</text>`);
        }
      });
      parts.push(`<g class="passes" data-b="${s}" data-r="${r}" stroke="#fff" stroke-width="0.5">${cells.join('')}</g>`);
      if (labels.length) {
        parts.push(`<g font-size="${Math.min(10, h - 4)}" text-anchor="middle" pointer-events="none">${labels.join('')}</g>`);
      }
      if (block.overlay) {
        block.overlay.ranks[r].forEach((q) => {
          parts.push(`<rect x="${x(q[4]).toFixed(2)}" y="${ry + 2}" width="${Math.max(0.5, (q[5] - q[4]) * scale).toFixed(2)}" ` +
                     `height="${h - 4}" fill="none" stroke="#000" stroke-width="1" stroke-dasharray="3 2" pointer-events="none"/>`);
        });
      }
    });
    y = top + ranks.length * h;
    if (arrows && block.deps) {  // (a block's dependencies come only when the arrows are on)
      parts.push('<g class="deps" stroke="#333" stroke-width="0.7" opacity="0.7">');
      for (const [r0, i0, r1, i1] of block.deps) {
        const a = ranks[r0][i0], b = ranks[r1][i1];
        parts.push(`<line class="dep" x1="${x(a[5]).toFixed(1)}" y1="${top + r0 * h + h / 2}" ` +
                   `x2="${x(b[4]).toFixed(1)}" y2="${top + r1 * h + h / 2}" marker-end="url(#arrow)"/>`);
      }
      parts.push('</g>');
    }
    if (block.memory) {
      y += 6;
      const mh = 56;
      const peak = Math.max(1e-12, ...block.memory.flat().map((pt) => pt[1]));
      parts.push(`<text x="${LEFT - 6}" y="${y + 10}" font-size="10" text-anchor="end" fill="#444">` +
                 `${memoryText(peak, block.run && block.run.memory_units === 'bytes')}</text>`);
      parts.push(`<text x="${LEFT - 6}" y="${y + mh}" font-size="10" text-anchor="end" fill="#444">0</text>`);
      parts.push(`<text x="4" y="${y + mh / 2 + 4}" font-size="10" fill="#444">memory</text>`);
      parts.push(`<rect x="${LEFT}" y="${y}" width="${(block.span * scale).toFixed(2)}" height="${mh}" fill="#fafafa" stroke="#e0e0e0"/>`);
      block.memory.forEach((points, r) => {
        let d = '';
        let last = 0;
        for (const [t, live] of points) {
          const yy = y + mh - (live / peak) * (mh - 4);
          d += d ? ` H${x(t).toFixed(1)} V${yy.toFixed(1)}` : `M${x(t).toFixed(1)} ${yy.toFixed(1)}`;
          last = t;
        }
        if (d) d += ` H${x(Math.max(last, block.span)).toFixed(1)}`;
        parts.push(`<path d="${d}" fill="none" stroke="${RANK_COLOURS[r % RANK_COLOURS.length]}" stroke-width="1.2"/>`);
      });
      y += mh;
    }
    y += 18;
  });
  // the shared axis
  const axis = [`<line x1="${LEFT}" y1="${y}" x2="${x(t1)}" y2="${y}" stroke="#666"/>`];
  for (const t of ticks(t1, width - LEFT - RIGHT)) {
    axis.push(`<line x1="${x(t)}" y1="${y}" x2="${x(t)}" y2="${y + 4}" stroke="#666"/>`);
    axis.push(`<line x1="${x(t)}" y1="4" x2="${x(t)}" y2="${y}" stroke="#000" stroke-opacity="0.06"/>`);
    axis.push(`<text x="${x(t)}" y="${y + 15}" font-size="10" text-anchor="middle" fill="#444">${units === 's' ? fmt(t * 1e3) : fmt(t)}</text>`);
  }
  axis.push(`<text x="${x(t1)}" y="${y + 28}" font-size="10" text-anchor="end" fill="#444">` +
            `time (${units === 's' ? 'ms' : units === 'F' ? 'forward units' : 'time units'})</text>`);
  y += 34;
  // legend
  const legend = [];
  let lx = LEFT;
  for (const kind of KINDS) {
    for (const c of [0, 1]) {
      const text = `${KIND_NAMES[kind]}${c ? ', odd chunk' : ''}`;
      legend.push(`<rect x="${lx}" y="${y}" width="12" height="10" fill="${COLOURS[kind][c]}"/>` +
                  `<text x="${lx + 16}" y="${y + 9}" font-size="10" fill="#333">${text}</text>`);
      lx += 24 + text.length * 5.6;
    }
  }
  legend.push(`<text x="${LEFT}" y="${y + 24}" font-size="10" fill="#333">labels: micro-batch (' = the second direction); ` +
              `memory: one line per rank (rank 0 blue, 1 orange, 2 green, …); dashed outlines: the prediction</text>`);
  y += 32;
  const defs = '<defs><marker id="arrow" viewBox="0 0 6 6" refX="6" refY="3" markerWidth="5" markerHeight="5" ' +
               'orient="auto"><path d="M0,0 L6,3 L0,6 z" fill="#333"/></marker></defs>';
  $('figure').innerHTML = `<svg xmlns="${SVGNS}" width="${width}" height="${y}" viewBox="0 0 ${width} ${y}" ` +
    `font-family="Helvetica, Arial, sans-serif">${defs}<rect width="${width}" height="${y}" fill="#fff"/>` +
    parts.join('') + axis.join('') + legend.join('') + '</svg>';
  state.blocks = blocks;
}

function runBlock(run) {
  const units = run.timeline.units;
  const title = `${run.label || run.schedule}   p=${run.p} m=${run.m}   T=${timeText(run.step, units)}` +
    `${run.chained ? ` (interlocked period; step ${run.focus} of a chained run, its neighbours faded)` : ''}` +
    `   bubble rate 1 − ${timeText(run.busy, units)} / ` +
    `${timeText(run.step, units)} = ${pct(run.bubble)} (rank ${run.bubble_rank})   peak act. mem ` +
    `${memoryText(run.peak_activation_memory, run.memory_units === 'bytes')}`;
  let span = run.step;
  for (const row of run.timeline.ranks) for (const q of row) span = Math.max(span, q[5]);
  return {title, run, timeline: run.timeline, span, memory: run.memory, deps: run.dependencies, focus: run.focus};
}

function render() {
  renderSummary();
  if (state.mode === 'trace' && state.trace) return renderTrace();
  const runs = state.runs.filter((r) => r && !r.error);
  if (!runs.length) {
    $('figure').innerHTML = '<p class="note">No schedule to draw: pick one that runs at this p and m.</p>';
    state.blocks = [];
    return;
  }
  drawFigure(runs.map(runBlock), runs[0].timeline.units);
}

function renderTrace() {
  const t = state.trace;
  const measured = t.measured.timeline;
  const predicted = t.predicted;
  const span = Math.max(t.measured.span, predicted.makespan);
  drawFigure([
    {title: `${t.schedule} measured, step ${t.iteration}: ${fmt(t.measured.span * 1e3)} ms; dashed: the simulator's ` +
            `prediction from the trace's own costs, ${fmt(predicted.makespan * 1e3)} ms`,
     timeline: measured, overlay: predicted.timeline, span, deps: null, memory: null},
    {title: `${t.schedule} predicted: ${fmt(predicted.makespan * 1e3)} ms, bubble rate ${pct(predicted.bubble)}`,
     run: predicted, timeline: predicted.timeline, span, deps: predicted.dependencies, memory: null},
  ], 's');
  $('summary').tBodies[0].insertAdjacentHTML('afterbegin',
    `<tr data-schedule="measured"><td>${esc(t.schedule)} measured</td>` +
    `<td data-field="step" data-value="${t.measured.span}">${timeText(t.measured.span, 's')}</td>` +
    '<td>–</td>'.repeat(6) + '</tr>');
}

// hover: what a pass is
function hover(event) {
  const target = event.target;
  const tip = $('tip');
  const group = target.parentNode;
  if (target.tagName !== 'rect' || !group || !group.classList || !group.classList.contains('passes')) {
    tip.hidden = true;
    return;
  }
  const block = state.blocks[+group.dataset.b];
  const q = block.timeline.ranks[+group.dataset.r][Array.prototype.indexOf.call(group.children, target)];
  const units = block.timeline.units;
  tip.textContent = `${KIND_NAMES[KINDS[q[0]]]} (${KINDS[q[0]]}) of micro-batch ${q[3]}` +
    `${q[6] !== null ? ', direction ' + q[6] : ''}\nrank ${group.dataset.r}, model stage ${q[1]}, chunk ${q[2]}` +
    `${q[8] ? ', step ' + q[8] : ''}\n${timeText(q[4], units)} → ${timeText(q[5], units)} ` +
    `(${timeText(q[5] - q[4], units)})${q[7] !== null ? '\nran as one unit with its pair' : ''}`;
  const box = $('figure-box').getBoundingClientRect();
  tip.style.left = (event.clientX - box.left + 12) + 'px';
  tip.style.top = (event.clientY - box.top + 12) + 'px';
  tip.hidden = false;
}

// ---------------------------------------------------------------------------------------------------------------
// the chooser

async function rank() {
  state.pending = false;
  if (state.mode === 'profile') setStatus('busy', 'ranking the profile…');
  const inp = inputs();
  $('chooser-status').textContent = 'ranking…';
  $('chooser-status').dataset.state = 'busy';
  const started = performance.now();
  const body = {p: inp.p, m: inp.m, F: inp.F, B: inp.B, W: inp.W, BW: inp.BW, split: inp.split, comm: inp.comm,
                memory_limit: inp.limit, profile: state.profile};
  try {
    state.chooser = await api('/api/choose', body);
    $('chooser-status').textContent = `ranked in ${(performance.now() - started).toFixed(0)} ms`;
    $('chooser-status').dataset.state = 'ready';
  } catch (e) {
    state.chooser = {error: e.message};
    $('chooser-status').textContent = e.message;
    $('chooser-status').dataset.state = 'error';
  }
  renderChooser();
  if (state.mode === 'profile') {
    if (state.chooser.error) {
      setStatus('error', state.chooser.error);
    } else {
      state.runs = state.chooser.runs;
      render();
      setStatus('ready', 'ready');
    }
  }
}

function renderChooser() {
  const c = state.chooser;
  const head = $('chooser').tHead, body = $('chooser').tBodies[0];
  if (!c) { head.innerHTML = ''; body.innerHTML = ''; $('chooser-summary').textContent = ''; return; }
  if (c.error) { head.innerHTML = ''; body.innerHTML = ''; $('chooser-summary').textContent = c.error; return; }
  const s = c.units === 's';
  const t = (x) => s ? fmt(x * 1e3) : fmt(x);
  const mem = (x) => s ? fmt(x / 1048576, 3) : fmt(x);
  head.innerHTML = '<tr><th>#</th><th class="text">schedule</th><th class="text">cut</th>' +
    `<th>step ${s ? 'ms' : ''}</th><th>span ${s ? 'ms' : ''}</th><th>bubble rate per rank</th>` +
    `<th>peak ${s ? 'MiB ' : ''}per rank</th></tr>`;
  const label = (row) => row.schedule + (row.virtual_stages ? ` v=${row.virtual_stages}` : '');
  const line = (row, i, cls) => `<tr class="${cls}" data-schedule="${esc(label(row))}"><td>${i}</td><td class="text">${esc(label(row))}</td>` +
    `<td class="text">${esc(row.cut)}</td><td data-field="step" data-value="${row.step_s}">${t(row.step_s)}</td>` +
    `<td>${t(row.span_s)}</td><td>${row.bubble.map(pct).join(' ')}</td>` +
    `<td data-field="peak" data-value="${Math.max(...row.peak_bytes)}">${row.peak_bytes.map(mem).join(' ')}</td></tr>`;
  body.innerHTML = c.choice.ranked.map((row, i) => line(row, i + 1, '')).join('') +
    c.choice.dropped.map((row) => line(row, 'over', 'over')).join('');
  const pick = c.choice.ranked[0];
  $('chooser-summary').textContent = `pick: ${label(pick)} (${pick.cut} cut), predicted ${t(pick.step_s)}` +
    `${s ? ' ms' : ''} per step; ${c.choice.dropped.length} over the memory limit; ` +
    `${c.choice.skipped.length} excluded by their constraints`;
}

// ---------------------------------------------------------------------------------------------------------------
// measured inputs: a saved profile, a trace

function readFile(input) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsText(input.files[0]);
  });
}

async function loadProfile() {
  if (!$('profile-file').files.length) return;
  state.generation++;
  setStatus('busy', 'reading the profile…');
  try {
    state.profile = JSON.parse(await readFile($('profile-file')));
  } catch (e) {
    setStatus('error', `profile: ${e.message}`);
    return;
  }
  state.mode = 'profile';
  setStatus('busy', 'ranking the profile…');
  await rank();
}

async function loadTrace() {
  if (!$('trace-file').files.length) return;
  state.generation++;
  setStatus('busy', 'reading the trace…');
  try {
    state.trace = await api('/api/trace', {trace: await readFile($('trace-file')), latency: 0});
  } catch (e) {
    setStatus('error', `trace: ${e.message}`);
    return;
  }
  state.mode = 'trace';
  state.runs = [state.trace.predicted];
  render();
  setStatus('ready', 'ready');
}

function clearMeasured() {
  state.mode = 'inputs';
  state.profile = state.trace = null;
  $('profile-file').value = '';
  $('trace-file').value = '';
  update();
}

// ---------------------------------------------------------------------------------------------------------------
// exports

function download(name, blob) {
  const a = document.createElement('a');
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.appendChild(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}

function svgText() {
  const svg = $('figure').querySelector('svg');
  return svg ? '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(svg) : null;
}

function pngBlob(scale = 2) {
  const svg = $('figure').querySelector('svg');
  const text = svgText();
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => {
      const canvas = document.createElement('canvas');
      canvas.width = svg.width.baseVal.value * scale;
      canvas.height = svg.height.baseVal.value * scale;
      const ctx = canvas.getContext('2d');
      ctx.fillStyle = '#fff';
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      canvas.toBlob(resolve, 'image/png');
    };
    img.onerror = () => reject(new Error('the SVG did not load as an image'));
    img.src = 'data:image/svg+xml;charset=utf-8,' + encodeURIComponent(text);
  });
}

async function perfettoText() {
  const requests = state.mode === 'inputs' ? state.requests : [];
  if (!requests.length) throw new Error('Perfetto export: simulated schedules only');
  return JSON.stringify(await api('/api/perfetto', {runs: requests}));
}

async function exportAs(kind) {
  try {
    if (kind === 'svg') download('explore.svg', new Blob([svgText()], {type: 'image/svg+xml'}));
    if (kind === 'png') download('explore.png', await pngBlob());
    if (kind === 'perfetto') download('explore-trace.json', new Blob([await perfettoText()], {type: 'application/json'}));
  } catch (e) {
    setStatus('error', e.message);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// start

async function start() {
  state.meta = await api('/api/meta');
  $('bubble-text').textContent = state.meta.bubble.text;
  $('memory-basis').textContent = state.meta.memory_basis;
  $('schedules').innerHTML = state.meta.schedules.map((s) =>
    `<label title="${esc(s.description)}"><input type="checkbox" value="${esc(s.name)}"> ${esc(s.name)}</label>`).join('');
  $('preset').insertAdjacentHTML('beforeend', state.meta.presets.map((p) =>
    `<option value="${esc(p.id)}">${esc(p.label)}</option>`).join(''));
  setInputs({schedules: ['1f1b', 'zb-h1', 'zb-v']});
  for (const id of ['p', 'm', 'v', 'F', 'B', 'W', 'BW', 'comm', 'limit']) $(id).addEventListener('input', changed);
  for (const id of ['chained', 'fused']) $(id).addEventListener('change', () => { showCostFields(); changed(); });
  $('schedules').addEventListener('change', changed);
  $('arrows').addEventListener('change', changed);  // the arrows come with the answers when asked for
  $('preset').addEventListener('change', () => {
    const preset = state.meta.presets.find((p) => p.id === $('preset').value);
    if (!preset) return;
    setInputs(preset.inputs);
    $('preset-what').textContent = preset.what;
    clearTimeout(timer);
    update();
  });
  $('rank').addEventListener('click', rank);
  $('profile-file').addEventListener('change', loadProfile);
  $('trace-file').addEventListener('change', loadTrace);
  $('clear-measured').addEventListener('click', clearMeasured);
  $('export-svg').addEventListener('click', () => exportAs('svg'));
  $('export-png').addEventListener('click', () => exportAs('png'));
  $('export-perfetto').addEventListener('click', () => exportAs('perfetto'));
  $('figure').addEventListener('mousemove', hover);
  $('figure').addEventListener('mouseleave', () => { $('tip').hidden = true; });
  window.addEventListener('resize', () => { clearTimeout(timer); timer = setTimeout(render, 100); });
  await update();
}

// for tests and the console
window.explore = {state, update, rank, svgText, pngBlob, perfettoText, setInputs};
start().catch((e) => setStatus('error', e.message));
