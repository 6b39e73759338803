"""A ~10 s run of scripts/soak.py (real server process, tiny Qwen3 plan, mixed traffic with disconnects).

The script's own checks decide the exit status; this test also reads its JSON to make sure the run did
something: requests of every kind served, deliberate disconnects, and the engine left idle with every KV block free.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT
from tests.fake_engine import tiny_plan
from tests.test_storm import NUM_BLOCKS


def test_short_soak_passes(tmp_path_factory, tmp_path):
    plan = tiny_plan(tmp_path_factory, NUM_BLOCKS)
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--plan", str(plan), "--duration", "10",
           "--clients", "4", "--disconnect-rate", "0.3", "--seed", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] and res["errors"] == 0 and res["engine_log_errors"] == 0, json.dumps(res)[-3000:]
    assert res["requests_ok"] >= 8 and res["disconnects"] >= 1 and res["completion_tokens"] > 0
    assert len(res["requests_by_kind"]) >= 3
    assert (res["end_running"], res["end_waiting"], res["end_kv_blocks_used"]) == (0, 0, 0)
    assert res["kv_blocks_total"] == NUM_BLOCKS and res["engine_healthy"] == 1
