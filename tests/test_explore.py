"""The schedule explorer (schedules/planner/explore.py, scripts/explore.py, docs/explore.md).

Its JSON API against the simulator, the chooser and the trace tools, without a browser; then the page itself in
headless Chromium (selenium and the system's chromedriver): inputs set as a person sets them, and the figures the
page shows read back from the page and held equal to what the simulator computes in this process. The browser
tests (and the script's, which starts a process) are in the multiprocess tier; they are skipped, saying why, only
where Chromium or its driver is not installed (.ci/run installs both).

EXPLORE_SCREENSHOT=docs/img/explore.png python -m pytest tests/test_explore.py -k screenshot  rewrites the README's
screenshot.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest

from schedules.observe.trace import (
    Tracer,
    load_chrome_trace,
    load_p2p_events,
    measured_dispatch,
    measured_p2p_cpu,
    one_iteration,
    predict,
    stream_messages,
    write_chrome_trace,
)
from schedules.planner import explore
from schedules.planner.choose import choose
from schedules.planner.profile import Profile
from schedules.registry import available_schedules
from schedules.simulator.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent


def schedule_table_rows(p, m):
    """scripts/schedule_table.py's rows (what `--stages p --micro-batches m --json` prints)."""
    spec = importlib.util.spec_from_file_location("schedule_table", ROOT / "scripts" / "schedule_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rows(p, m)


def post(url, path, body):
    req = urllib.request.Request(url + path.lstrip('/'), json.dumps(body).encode(),
                                 {'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server():
    srv, url = explore.serve(workers=0)  # simulating in its own threads: no process started
    yield url
    srv.shutdown()
    srv.server_close()


def write_trace(path, schedule="zb-h1", p=2, m=4):
    """A Chrome trace as train.py --trace writes it (write_chrome_trace), of 2 steps whose passes took uneven
    seconds, plus the p2p records of their sends and receives."""
    spec = available_schedules()[schedule]
    place = spec.placement(p)
    seconds = {'F': 1e-3, 'B': 1.2e-3, 'W': 0.7e-3, 'BW': 1.9e-3}
    result = simulate(schedule, p, m, costs=lambda r, c, k: seconds[k] * (1 + 0.3 * r), latency=1e-4, iterations=3)
    tracers = []
    for r, row in enumerate(result.chained.ranks):
        passes = [q for q in row if q.iteration < 2]
        for n, q in enumerate(passes):  # jitter: every fifth pass 20% slower
            if n % 5 == 0:
                q.end += 0.2 * q.duration
        tracer = Tracer(r, place)
        tracer.passes = passes
        tracer.p2p = [('SendActivation', q.end, q.end + 2e-5, q.iteration) for q in passes if q.kind == 'F']
        tracers.append(tracer)
    write_chrome_trace(tracers, path, {'schedule': schedule, 'stages': p, 'micro_batches': m})
    return path


def expected_prediction(path):
    """What scripts/plot_trace.py predicts for the trace's last step."""
    timeline, _ = load_chrome_trace(path)
    measured = one_iteration(timeline, timeline.iterations()[-1])
    events = load_p2p_events(path)
    meta = timeline.meta
    messages = stream_messages(meta['schedule'], meta['stages'], meta['micro_batches'])
    return measured, predict(measured, 0.0, measured_p2p_cpu(events, messages), measured_dispatch(timeline, events))


# ----------------------------------------------------------------------------------------------
# The API, without a browser

@pytest.mark.parametrize("name", list(available_schedules()))
def test_simulate_answers_the_simulators_figures(name):
    run = explore.simulated({'schedule': name, 'p': 4, 'm': 8})
    try:
        ref = simulate(name, 4, 8, iterations=1)
    except ValueError as e:  # a schedule that refuses p = 4, m = 8 says so, and nothing else
        assert run['error'] == str(e) and 'timeline' not in run
        return
    assert run['error'] is None
    assert (run['makespan'], run['step']) == (ref.makespan, ref.makespan)
    assert run['idle_synced'] == ref.worst('idle_synced')
    assert run['peak_activation_memory'] == ref.worst('peak_activation_memory')
    assert [row['peak_activation_memory'] for row in run['per_rank']] == \
        [row['peak_activation_memory'] for row in ref.per_rank]
    assert run['bubble'] == max(row['idle_synced'] / ref.makespan for row in ref.per_rank)
    drawn = run['timeline']['ranks']
    assert [[tuple(q[1:6]) for q in row] for row in drawn] == \
        [[(q.stage, q.chunk, q.micro_batch, q.start, q.end) for q in row] for row in ref.timeline.ranks]
    # memory over time, from the simulator's own memory table, peaks where the simulator says
    assert [max(live for _, live in points) for points in run['memory']] == \
        [row['peak_activation_memory'] for row in ref.per_rank]
    # chained: the interlocked figures, and the middle step drawn in the window of its span
    run = explore.simulated({'schedule': name, 'p': 4, 'm': 8, 'chained': True})
    ref = simulate(name, 4, 8)
    assert (run['period'], run['step'], run['idle_interlocked']) == (ref.period, ref.period,
                                                                     ref.worst('idle_interlocked'))
    assert run['bubble'] == max(row['idle_interlocked'] / ref.period for row in ref.per_rank)
    t0, _ = ref.chained.span(run['focus'])
    assert [[tuple(q[3:6]) for q in row if q[8] == run['focus']] for row in run['timeline']['ranks']] == \
        [[(q.micro_batch, q.start - t0, q.end - t0) for q in row if q.iteration == run['focus']]
         for row in ref.chained.ranks]


def test_the_table_preset_is_what_schedule_table_prints():
    preset = next(p for p in explore.PRESETS if p['id'] == 'table')['inputs']
    for row in schedule_table_rows(4, 8):
        run = explore.simulated(dict(preset, schedule=row['schedule']))
        if row['error']:
            assert run['error'] == row['error']
            continue
        assert (run['idle_interlocked'], run['idle_synced'], run['peak_activation_memory'],
                run['params_per_rank']) == (row['idle_time'], row['idle_time_synced'],
                                            row['peak_activation_memory'], row['params_per_rank'])


def test_a_refused_schedule_says_why():
    run = explore.simulated({'schedule': 'dualpipe', 'p': 3, 'm': 8})
    with pytest.raises(ValueError) as ref:
        simulate('dualpipe', 3, 8)
    assert run['error'] == str(ref.value)
    assert explore.simulated({'schedule': 'zb-v', 'p': 1, 'm': 8})['error'] == 'zb-v needs p >= 2'


@pytest.mark.parametrize("name", list(available_schedules()))
def test_dependencies_run_in_order(name):
    """Every pass starts after the pass it needs (plus the message's latency between ranks), and every pass
    but the first stage's forwards needs one."""
    comm = 0.25
    run = explore.simulated({'schedule': name, 'p': 4, 'm': 8, 'comm': comm, 'F': 1, 'B': 1.5, 'W': 0.5})
    if run['error']:
        pytest.skip(run['error'])
    ranks = run['timeline']['ranks']
    for r0, i0, r1, i1 in run['dependencies']:
        assert ranks[r1][i1][4] >= ranks[r0][i0][5] + (comm if r0 != r1 else 0) - 1e-9
    first_forwards = sum(1 for row in ranks for q in row if q[0] == 0 and q[1] == 0)
    assert len(run['dependencies']) == sum(map(len, ranks)) - first_forwards


def test_costs_scale_each_kind():
    """F, B and W set apart: each rank is busy m (F + B + W) whatever its chunks (1/p of the model each)."""
    F, B, W = 1.0, 2.0, 0.5
    for name in ('1f1b', 'zb-h1', 'zb-v', 'v-min', 'interleaved'):
        run = explore.simulated({'schedule': name, 'p': 4, 'm': 8, 'F': F, 'B': B, 'W': W})
        assert [row['busy'] for row in run['per_rank']] == [8 * (F + B + W)] * 4
        assert run['units'] == 'time'
    fused = explore.simulated({'schedule': 'zb-h1', 'p': 4, 'm': 8, 'F': 1, 'BW': 3, 'split': False})
    assert [row['busy'] for row in fused['per_rank']] == [8 * 4.0] * 4


def test_the_chooser_ranks_the_inputs_and_a_profile():
    out = explore.chosen({'p': 4, 'm': 8, 'draw': 2})
    ref = choose(explore.synthetic_profile(4, 1.0, 1.0, 1.0, 0.0), 4, 8)
    assert [(c['schedule'], c['step_s']) for c in out['choice']['ranked']] == \
        [(c.schedule, c.step) for c in ref.ranked]
    assert ref.pick.schedule == 'zb-v' and ref.pick.step == simulate('zb-v', 4, 8).makespan
    assert [run['step'] for run in out['runs']] == [c.span for c in ref.ranked[:2]]
    # a limit in units of activation memory drops what peaks above it
    limited = explore.chosen({'p': 4, 'm': 8, 'memory_limit': 3})
    assert {c['schedule'] for c in limited['choice']['ranked']} == {'v-min', 'v-half'}
    # a profile saved by choose_schedule.py --save: seconds and bytes, the chooser's own figures
    profile = Profile.synthetic(8, F=1e-3, B=1.5e-3, W=0.5e-3, saved=1 << 20, latency=1e-5)
    out = explore.chosen({'p': 4, 'm': 8, 'profile': profile.to_json(), 'memory_limit': 12})
    ref = choose(profile, 4, 8, 12)
    assert out['units'] == 's' and out['table'][1:] == [line for line in
                                                        __import__('schedules.planner.choose', fromlist=['table'])
                                                        .table(ref)][1:]
    assert [run['step'] for run in out['runs']] == [c.span for c in ref.ranked[:4]]
    assert all(max(run['peak_activation_memory'] for run in out['runs']) <= 12 << 20 for _ in [0])


def test_memory_over_time_shows_what_a_pass_holds_while_it_runs():
    """A split head's recomputed logits live inside its fused backward (a memory table's `within`): the curve
    drawn, from the timeline or from the result's columns, peaks where the simulator's peak is, above every
    pass's end (dualpipev +vocab, GPTlite small's stored profile, p = 2, m = 4: rank 1 40.3 MiB, 25.7 at the
    passes' ends)."""
    profile = Profile.load(Path(__file__).resolve().parent.parent / 'docs' / 'bench' / 'profile-gptlite-small.json')
    pick = [c for c in choose(profile, 2, 4, split=True, schedules=['dualpipev'], cuts=['uniform']).ranked
            if c.vocab_parallel][0]
    result, place, memory = explore.candidate_run(profile, pick, 2, 4)
    peaks = [row['peak_activation_memory'] for row in result.per_rank]
    for deps in (True, False):
        drawn = explore.figures(result, place, False, memory, with_dependencies=deps)['memory']
        assert [max(live for _, live in points) for points in drawn] == pytest.approx(peaks)
    ends = explore.figures(result, place, False, {k: {kind: v for kind, v in m.items() if kind != 'within'}
                                                  for k, m in memory.items()})['memory']
    assert max(live for _, live in ends[1]) < peaks[1] - 10 * 2**20


def test_a_trace_is_drawn_over_its_prediction(tmp_path):
    path = write_trace(tmp_path / "trace.json")
    out = explore.traced({'trace': path.read_text()})
    measured, predicted = expected_prediction(path)
    assert out['iteration'] == 1 and out['schedule'] == 'zb-h1'
    assert out['measured']['span'] == measured.span()[1]
    assert out['predicted']['makespan'] == predicted.makespan
    assert out['predicted']['timeline']['units'] == 's'
    with pytest.raises(explore.BadRequest, match="not a trace"):
        explore.traced({'trace': '{"nothing": 1}'})


def test_perfetto_export(tmp_path):
    out = explore.perfetto({'runs': [{'schedule': 'zb-v', 'p': 4, 'm': 8}, {'schedule': '1f1b', 'p': 4, 'm': 8}]})
    events = json.loads(json.dumps(out))['traceEvents']
    complete = [e for e in events if e['ph'] == 'X']
    ref = [simulate(name, 4, 8, iterations=1).timeline for name in ('zb-v', '1f1b')]
    assert len(complete) == sum(len(row) for t in ref for row in t.ranks)
    names = {e['args']['name'] for e in events if e.get('name') == 'process_name'}
    assert {'zb-v: rank 0', '1f1b: rank 3'} <= names
    counters = [e for e in events if e['ph'] == 'C']
    assert max(e['args']['live'] for e in counters if e['pid'] < 100) == 4
    starts = {e['id'] for e in events if e['ph'] == 's'}
    assert starts and starts == {e['id'] for e in events if e['ph'] == 'f'}


def test_the_server(server):
    with urllib.request.urlopen(server, timeout=10) as r:
        assert b'explore.js' in r.read()
    for name in ('explore.js', 'explore.css'):
        with urllib.request.urlopen(server + name, timeout=10) as r:
            assert r.status == 200
    meta = json.loads(urllib.request.urlopen(server + 'api/meta', timeout=10).read())
    assert [s['name'] for s in meta['schedules']] == list(available_schedules())
    req = {'schedule': 'zb-v', 'p': 4, 'm': 8}
    for _ in range(2):  # computed, then from the cache: the same answer as from Python
        sent = post(server, '/api/simulate', req)
        assert sent['makespan'] == 25.5 and sent.pop('seconds') >= 0
        assert sent == json.loads(json.dumps({k: v for k, v in explore.simulated(req).items() if k != 'seconds'}))
    assert 'dependencies' not in post(server, '/api/simulate', dict(req, dependencies=False))
    for body, why in (({'schedule': 'zb-v', 'p': 0}, 'p 0: outside 1 .. 64'), ({'schedule': 'x'}, "schedule 'x'")):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, '/api/simulate', body)
        assert e.value.code == 400 and why in json.loads(e.value.read())['error']
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server + '..%2F__init__.py', timeout=10)
    assert e.value.code == 404


@pytest.mark.multiprocess
def test_the_script_prints_its_address():
    """scripts/explore.py prints where it serves; a kill stops it and the processes it simulates in."""
    import psutil
    proc = subprocess.Popen([sys.executable, str(ROOT / 'scripts' / 'explore.py'), '--port', '0', '--no-browser'],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith('http://127.0.0.1:') and url.endswith('/')
        with urllib.request.urlopen(url, timeout=10) as r:
            assert b'Pipeline schedule explorer' in r.read()
        assert post(url, '/api/simulate', {'schedule': 'zb-h1', 'p': 4, 'm': 8})['makespan'] == 27
        workers = psutil.Process(proc.pid).children()
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []


# ----------------------------------------------------------------------------------------------
# The page, in headless Chromium

def _browser_paths():
    browser = next((shutil.which(n) for n in ('chromium', 'chromium-browser', 'google-chrome') if shutil.which(n)),
                   None)
    driver = shutil.which('chromedriver') or next(
        (p for p in ('/usr/lib/chromium/chromedriver', '/usr/bin/chromedriver') if os.path.exists(p)), None)
    return browser, driver


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    browser, driver_path = _browser_paths()
    if browser is None or driver_path is None:
        pytest.skip("headless Chromium and chromedriver are not installed (apt-get install chromium chromium-driver, "
                    "as .ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (requirements.txt)")
    from selenium.webdriver.chrome.service import Service
    os.environ.setdefault('SE_OFFLINE', 'true')  # the browser and its driver are the system's: fetch nothing
    downloads = tmp_path_factory.mktemp("downloads")
    opts = webdriver.ChromeOptions()
    for arg in ('--headless=new', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-dev-shm-usage',
                '--window-size=1500,1100', f'--user-data-dir={tmp_path_factory.mktemp("chromium-profile")}'):
        opts.add_argument(arg)
    opts.binary_location = browser
    opts.add_experimental_option('prefs', {'download.default_directory': str(downloads),
                                           'download.prompt_for_download': False})
    driver = webdriver.Chrome(options=opts, service=Service(driver_path))
    driver.execute_cdp_cmd('Page.setDownloadBehavior', {'behavior': 'allow', 'downloadPath': str(downloads)})
    srv, url = explore.serve(workers=2)  # as scripts/explore.py serves it on 2 cores
    driver.get(url)
    page = SimpleNamespace(driver=driver, downloads=downloads, url=url)
    wait_ready(page)
    yield page
    driver.quit()
    srv.shutdown()
    srv.server_close()


def wait_ready(page, timeout=30):
    """Until the page has answered the last change of its inputs (none waiting for the page's short debounce)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state, text, pending = page.driver.execute_script(
            "const s = document.getElementById('status');"
            "return [s.dataset.state, s.textContent, window.explore.state.pending];")
        if not pending:
            if state == 'ready':
                return
            assert state != 'error', text
        time.sleep(0.05)
    raise AssertionError(f"the page did not answer within {timeout} s")


def set_inputs(page, schedules=None, **values):
    """Type into the inputs as a person does (select all, type over it), tick the schedules, then wait for the
    answer."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    d = page.driver
    for key, value in values.items():
        box = d.find_element(By.ID, key)
        if box.get_attribute('type') == 'checkbox':
            if box.is_selected() != bool(value):
                box.click()
        else:
            box.send_keys(Keys.CONTROL, 'a')
            box.send_keys(str(value) if value != '' else Keys.BACKSPACE)
    if schedules is not None:
        for box in d.find_elements(By.CSS_SELECTOR, '#schedules input'):
            if box.is_selected() != (box.get_attribute('value') in schedules):
                box.click()
    wait_ready(page)


def shown(page):
    """{schedule: {field: value}} of the summary table, as the page shows it (each cell's data-value)."""
    return page.driver.execute_script("""
        const out = {};
        for (const tr of document.querySelectorAll('#summary tbody tr')) {
          const row = out[tr.dataset.schedule] = {};
          for (const td of tr.querySelectorAll('td[data-field]')) row[td.dataset.field] = td.dataset.value;
        }
        return out;""")


def assert_shows_the_simulation(page, names, p, m, chained=False, **costs):
    rows = shown(page)
    assert sorted(rows) == sorted(names)
    for name in names:
        per_kind = {'F': costs.get('F', 1.0), 'B': costs.get('B', 1.0), 'W': costs.get('W', 1.0)}
        per_kind['BW'] = per_kind['B'] + per_kind['W']
        place = available_schedules()[name].placement(p)
        kw = {} if per_kind == {'F': 1.0, 'B': 1.0, 'W': 1.0, 'BW': 2.0} else {
            'costs': lambda r, c, k: per_kind[k] * place.chunk_size(r, c)}
        ref = simulate(name, p, m, iterations=5 if chained else 1, **kw)
        step = ref.period if chained else ref.makespan
        idle = 'idle_interlocked' if chained else 'idle_synced'
        row = rows[name]
        assert float(row['step']) == step, name
        assert float(row['idle_synced']) == ref.worst('idle_synced'), name
        assert float(row['bubble']) == max(r[idle] / step for r in ref.per_rank), name
        assert float(row['peak_activation_memory']) == ref.worst('peak_activation_memory'), name
        assert [float(x) for x in row['peak_per_rank'].split()] == \
            [r['peak_activation_memory'] for r in ref.per_rank], name
        if chained:
            assert float(row['idle_interlocked']) == ref.worst('idle_interlocked'), name


@pytest.mark.multiprocess  # a browser
def test_page_shows_the_simulators_figures(page):
    from selenium.webdriver.common.by import By
    set_inputs(page, schedules=['1f1b', 'zb-h1', 'zb-v', 'dualpipe'], p=6, m=12, chained=False)
    assert_shows_the_simulation(page, ['1f1b', 'zb-h1', 'zb-v', 'dualpipe'], 6, 12)
    # one cell per pass, as many as the simulator ran
    rects = page.driver.find_elements(By.CSS_SELECTOR, '#figure g.passes > rect')
    assert len(rects) == sum(len(row) for name in ('1f1b', 'zb-h1', 'zb-v', 'dualpipe')
                             for row in simulate(name, 6, 12, iterations=1).timeline.ranks)
    set_inputs(page, F=1, B=2, W=0.5, comm=0, chained=True)
    assert_shows_the_simulation(page, ['1f1b', 'zb-h1', 'zb-v', 'dualpipe'], 6, 12, chained=True, F=1, B=2, W=0.5)
    set_inputs(page, B=1, W=1, chained=False)


@pytest.mark.multiprocess  # a browser
def test_page_presets_reproduce_the_schedule_table(page):
    from selenium.webdriver.support.ui import Select
    Select(page.driver.find_element('id', 'preset')).select_by_value('table')
    wait_ready(page)
    rows = shown(page)
    for ref in schedule_table_rows(4, 8):
        row = rows[ref['schedule']]
        if ref['error']:
            assert row == {}
            continue
        assert (float(row['idle_interlocked']), float(row['idle_synced']), float(row['peak_activation_memory']),
                float(row['params_per_rank'])) == (ref['idle_time'], ref['idle_time_synced'],
                                                   ref['peak_activation_memory'], ref['params_per_rank'])
    for preset in explore.PRESETS[1:]:
        Select(page.driver.find_element('id', 'preset')).select_by_value(preset['id'])
        wait_ready(page)
        i = preset['inputs']
        assert_shows_the_simulation(page, i['schedules'], i['p'], i['m'], i['chained'])


@pytest.mark.multiprocess  # a browser
def test_page_hover_arrows_and_exports(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    set_inputs(page, schedules=['zb-h1', 'zb-v'], p=4, m=8, chained=False, arrows=True)
    lines = page.driver.find_elements(By.CSS_SELECTOR, '#figure line.dep')
    assert len(lines) == sum(len(explore.simulated({'schedule': n, 'p': 4, 'm': 8})['dependencies'])
                             for n in ('zb-h1', 'zb-v'))
    set_inputs(page, arrows=False)
    cell = page.driver.find_elements(By.CSS_SELECTOR, '#figure g.passes > rect')[5]
    ActionChains(page.driver).move_to_element(cell).perform()
    tip = page.driver.find_element(By.ID, 'tip')
    assert tip.is_displayed() and 'micro-batch' in tip.text and 'rank 0' in tip.text
    for button, name in (('export-svg', 'explore.svg'), ('export-png', 'explore.png'),
                         ('export-perfetto', 'explore-trace.json')):
        page.driver.find_element(By.ID, button).click()
        path = page.downloads / name
        deadline = time.time() + 10
        while not path.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert path.exists(), name
    passes = sum(len(row) for n in ('zb-h1', 'zb-v') for row in simulate(n, 4, 8, iterations=1).timeline.ranks)
    root = ElementTree.parse(page.downloads / 'explore.svg').getroot()
    assert root.tag == '{http://www.w3.org/2000/svg}svg'
    assert len(root.findall('.//{http://www.w3.org/2000/svg}g[@class="passes"]/{http://www.w3.org/2000/svg}rect')) \
        == passes
    png = (page.downloads / 'explore.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and int.from_bytes(png[16:20], 'big') > 1000  # 2x the page's width
    trace = json.loads((page.downloads / 'explore-trace.json').read_text())
    assert sum(e['ph'] == 'X' for e in trace['traceEvents']) == passes


@pytest.mark.multiprocess  # a browser
def test_page_draws_a_trace_over_its_prediction_and_ranks_a_profile(page, tmp_path):
    from selenium.webdriver.common.by import By
    path = write_trace(tmp_path / 'trace.json')
    measured, predicted = expected_prediction(path)
    page.driver.find_element(By.ID, 'trace-file').send_keys(str(path))
    wait_ready(page)
    rows = shown(page)
    assert float(rows['measured']['step']) == measured.span()[1]
    assert float(rows['predicted']['step']) == predicted.makespan
    # the measured passes filled, the predicted ones drawn over them, then alone
    assert len(page.driver.find_elements(By.CSS_SELECTOR, '#figure g.passes > rect')) == 2 * len(measured.passes())

    profile = Profile.synthetic(8, F=1e-3, B=1.5e-3, W=0.5e-3, saved=1 << 20, latency=1e-5)
    saved = tmp_path / 'profile.json'
    profile.save(saved)
    page.driver.find_element(By.ID, 'clear-measured').click()
    wait_ready(page)
    set_inputs(page, p=4, m=8, limit=12)
    page.driver.find_element(By.ID, 'profile-file').send_keys(str(saved))
    wait_ready(page)
    ref = choose(profile, 4, 8, 12)
    ranked = page.driver.execute_script(
        "return [...document.querySelectorAll('#chooser tbody tr:not(.over)')].map(tr => "
        "[tr.dataset.schedule, +tr.querySelector('td[data-field=step]').dataset.value])")
    assert ranked == [[c.label, c.step] for c in ref.ranked]
    page.driver.find_element(By.ID, 'clear-measured').click()
    set_inputs(page, limit='')


@pytest.mark.multiprocess  # a browser
def test_page_answers_fast(page):
    """A change of inputs at p = 16, m = 64, three schedules: the time from the change to the drawn answer."""
    def answered():
        return float(page.driver.find_element('id', 'timing').get_attribute('data-ms'))
    set_inputs(page, schedules=['1f1b', 'zb-h1', 'zb-v'], p=4, m=8, chained=False)
    set_inputs(page, p=16, m=64)
    cold = answered()
    warm = []
    for _ in range(3):  # the same inputs again: the server's cache answers (the best of 3: the machine is shared)
        set_inputs(page, m=63)
        set_inputs(page, m=64)
        warm.append(answered())
    print(f"p = 16, m = 64, 1f1b + zb-h1 + zb-v: {cold:.0f} ms to the drawn answer, {min(warm):.0f} ms cached")
    assert_shows_the_simulation(page, ['1f1b', 'zb-h1', 'zb-v'], 16, 64)
    assert min(warm) < 300


@pytest.mark.multiprocess  # a browser
def test_screenshot(page, tmp_path):
    """The README's screenshot: the ZB paper's preset with its dependency arrows off. Written to
    $EXPLORE_SCREENSHOT when set, else only checked."""
    from selenium.webdriver.support.ui import Select
    page.driver.set_window_size(1600, 1000)
    Select(page.driver.find_element('id', 'preset')).select_by_value('zero-bubble')
    wait_ready(page)
    out = Path(os.environ.get('EXPLORE_SCREENSHOT') or tmp_path / 'explore.png')
    assert page.driver.save_screenshot(str(out))
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_a_gptlite_profile_is_ranked_with_its_head_split_too():
    """The page ranks what train.py --pipeline-schedule auto ranks for GPTlite: the split head's candidates too,
    each drawn from the profile with its head split (the chooser's own figures)."""
    profile = Profile.synthetic(6, F=1e-3, B=1e-3, W=1e-3, saved=1 << 20)
    head = profile.layers[-1]
    head.F, head.B, head.W, head.BW = 1e-2, 1e-2, 1e-2, 2e-2
    profile.meta["model"] = "gptlite"
    out = explore.chosen({'p': 4, 'm': 8, 'profile': profile.to_json(), 'draw': 3})
    ref = choose(profile, 4, 8, split=True)
    assert [(c['schedule'], c['vocab_parallel'], c['step_s']) for c in out['choice']['ranked']] == \
        [(c.schedule, c.vocab_parallel, c.step) for c in ref.ranked]
    assert ref.pick.vocab_parallel and out['runs'][0]['label'].startswith(ref.pick.label)
    first = {}
    for c in ref.ranked:  # the page draws the best cut of each of the first 3 schedules
        first.setdefault(c.label, c)
    assert [run['step'] for run in out['runs']] == [c.span for c in list(first.values())[:3]]
