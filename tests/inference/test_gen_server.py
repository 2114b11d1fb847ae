"""tools/run_text_generation_server.py: Megatron's PUT /api request and response format, HTTP 400 for bad
requests, and the web page at / driven in a real headless Chromium.

The server runs as in production: two torchrun ranks (TP=2) with a tiny random GPT, rank 0 serving HTTP on
127.0.0.1 and rank 1 following its broadcasts.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from helpers.dist_harness import free_ports
from helpers.gen_helpers import REPO, TINY_GPT

pytest.importorskip("flask", reason="the text generation server needs Flask (pip install -e '.[test]')")

CHROMIUM_CANDIDATES = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]


def _request(url, method="GET", body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, master_port = free_ports(2)
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, MEGATRON_FORCE_CPU="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(master_port),
           os.path.join(REPO, "tools", "run_text_generation_server.py"), *TINY_GPT,
           "--tensor-model-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail("server exited with code {}:\n{}".format(proc.returncode, log_path.read_text()[-4000:]))
            try:
                if _request(url + "/")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail("server did not answer in 120 s:\n" + log_path.read_text()[-4000:])
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def test_gen_server_api_format_and_bad_requests(server):
    api = server + "/api"
    status, body = _request(api, "PUT", {"prompts": ["Hello world", "The"], "tokens_to_generate": 5})
    assert status == 200, body
    out = json.loads(body)
    assert set(out) == {"text", "segments", "logprobs"} and out["logprobs"] is None
    assert len(out["text"]) == 2 and out["text"][0].startswith("Hello world") and out["text"][1].startswith("The")
    assert all("".join(seg) == text for seg, text in zip(out["segments"], out["text"]))

    greedy = {"prompts": ["Hello world"], "tokens_to_generate": 6, "logprobs": True, "top_k": 1, "no_log": True}
    first, second = (json.loads(_request(api, "PUT", greedy)[1]) for _ in range(2))
    assert first == second  # greedy is deterministic across requests (the KV cache is per request)
    assert len(first["logprobs"][0]) == len(first["segments"][0]) - 1
    assert all(isinstance(x, float) and x <= 0.0 for x in first["logprobs"][0])

    seeded = dict(greedy, top_k=20, temperature=0.8, random_seed=11)
    assert json.loads(_request(api, "PUT", seeded)[1]) == json.loads(_request(api, "PUT", seeded)[1])

    status, body = _request(api, "PUT", {"prompts": ["Hello"], "tokens_to_generate": 4, "beam_width": 2})
    assert status == 200, body
    beam = json.loads(body)
    assert set(beam) == {"text", "segments", "scores"} and len(beam["text"]) == 2 and len(beam["scores"]) == 2
    assert beam["scores"][0] >= beam["scores"][1]

    bad = [
        ({"tokens_to_generate": 4}, "prompts argument required"),
        ({"prompts": "Hello"}, "prompts is not a list of strings"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["x"] * 129}, "Maximum number of prompts is 128"),
        ({"prompts": ["Hi"], "tokens_to_generate": "ten"}, "tokens_to_generate must be an integer"),
        ({"prompts": ["Hi"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer"),
        ({"prompts": ["Hi"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
        ({"prompts": ["Hi"], "temperature": 0}, "temperature must be a positive number"),
        ({"prompts": ["Hi"], "top_k": 5, "top_p": 0.5}, "cannot set both top-k and top-p samplings."),
        ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
        ({"prompts": ["a", "b"], "beam_width": 2}, "When doing beam_search, batch size must be 1"),
        ({"prompts": ["Hi"], "tokens_to_generate": 1000}, "Length of prompt + tokens_to_generate longer than"),
        ({"prompts": ["Hi"], "max_len": 5}, "max_len is no longer used"),
        ({"prompts": ["Hi"], "logprobs": "yes"}, "logprobs must be a boolean value"),
    ]
    for request, message in bad:
        status, body = _request(api, "PUT", request)
        assert status == 400 and message in body, (request, status, body)
    status, body = _request(api, "PUT", raw=b"{not json")
    assert status == 400 and "JSON" in body
    # Still serving, and every rank is still in step.
    assert json.loads(_request(api, "PUT", greedy)[1]) == first


def _chromium():
    for path in CHROMIUM_CANDIDATES:
        if os.path.exists(path):
            return path
    return shutil.which("chromium")


def test_gen_server_web_page_in_headless_chromium(server):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does it when root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.fill("#prompt", "Once upon a time")
            page.fill("#tokens", "8")
            page.click("#generate")
            page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=60000)
            completion = page.text_content("#completion")
            assert completion.startswith("Once upon a time") and len(completion) > len("Once upon a time")
            assert page.text_content("#error") == ""

            # A request the server refuses shows its message on the page.
            page.fill("#tokens", "1000")
            page.click("#generate")
            page.wait_for_function("document.getElementById('error').textContent !== ''", timeout=60000)
            assert "Error 400" in page.text_content("#error")
            assert "longer than allowed" in page.text_content("#error")
        finally:
            browser.close()
