"""The scripts under scripts/ refuse bad input in argparse's error (status 2, the
flag named) before they start anything: no traceback, no benchmark run."""
import os
import runpy
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")


@pytest.mark.parametrize("script,args,message", [
    ("bench_runtime.py", ["--rounds", "0"], "--rounds must be at least 1 (got 0)"),
    ("bench_runtime.py", ["--iterations", "4"], "--iterations must be at least 12 (got 4)"),
    ("bench_split.py", ["--rounds", "0"], "--rounds must be at least 1 (got 0)"),
    ("bench_split.py", ["--iterations", "6"], "--iterations must be at least 7 (got 6)"),
    ("bench_runtime.py", ["--modes", "eager,lazy"], "--modes 'eager,lazy': expected off and any of"),
    ("bench_runtime.py", ["--modes", "off,bogus"], "--modes 'off,bogus': expected off and any of"),
    ("bench_tokens.py", ["--rounds", "0"], "--rounds must be at least 1 (got 0)"),
    ("bench_schedules.py", ["--forward", "-1"], "--forward must be a finite number above 0 (got -1.0)"),
    ("bench_schedules.py", ["--swap", "nan"], "--swap must be a finite number not negative (got nan)"),
    ("sim_frc.py", ["--stages", "x"], "--stages 'x': expected whole numbers"),
    ("sim_frc.py", ["--stages", "0"], "each at least 2"),
    ("sim_frc.py", ["--pipelines", "0"], "--pipelines '0'"),
    ("sim_frc.py", ["--models", "bogus"], "--models: unknown bogus"),
    ("sim_frc.py", ["--json", "/proc/no/x.json"], "--json '/proc/no/x.json': cannot write a file there"),
    ("sim_gains.py", ["--stages", "1"], "each at least 2"),
    ("sim_gains.py", ["--model", "bogus"], "--model 'bogus': unknown"),
    ("bench_single.py", ["--seq", "0"], "--seq must be at least 1 (got 0)"),
    ("bench_single.py", ["--json", "/proc/no/x.json"], "--json '/proc/no/x.json': cannot write a file there"),
    ("bench_hotpath.py", ["--rtol", "nan"], "--rtol must be a finite number above 0"),
    ("bench_comm.py", ["--shape", "8,0,256"], "--shape: every size must be at least 1"),
    ("bench_memory.py", ["--model", "bogus"], "--model bogus: "),
    ("bench_rollback.py", ["--iterations", "10"], "--iterations must be at least 11 (got 10)"),
    ("bench_short_pipelines.py", ["--batch", "0"], "--batch must be at least 1 (got 0)"),
    ("calibrate_sim.py", ["--models", "gpt2,bogus"], "--models: unknown 'bogus'"),
])
def test_bad_input_is_argparse_s_error_before_any_work(script, args, message, tmp_path, capsys, monkeypatch):
    """Each script run as __main__ in this process (a process each would import torch
    two dozen times; the test below starts one), from another directory: nothing may
    depend on the cwd. An exception other than argparse's exit fails the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", [os.path.abspath(SCRIPTS), *sys.path])  # as python puts a script's directory
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(os.path.join(SCRIPTS, script), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err.strip().splitlines()[-1], err


def test_a_script_started_as_a_process_refuses_the_same(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_runtime.py"), "--rounds", "0"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)  # not the checkout's directory
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--rounds must be at least 1 (got 0)" in out.stderr.strip().splitlines()[-1], out.stderr
