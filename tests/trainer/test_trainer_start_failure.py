"""The trainer entry point on a model it cannot load (rljob_api.start_failure, DESIGN §5 "Start failures"): one rank
(``python -m rljob_trainer.train``) exits 78 with the permanent line naming the field and its value in its termination
message file and last in its log; under torchrun, as a trainer pod runs it, torchrun exits 1 but the file the rank
wrote is what the operator reads. Real processes, a real Redis."""

from __future__ import annotations

import pytest

from portutil import free_port
from rljob_api import constants as c
from rljob_api.start_failure import PERMANENT, permanent
from start_cases import UNLOADABLE, run_entry, unloadable
from train_harness import Torchrun, make_config, write_config

pytestmark = pytest.mark.usefixtures("no_torchrun_env")


@pytest.mark.parametrize("case", UNLOADABLE)
def test_a_model_the_trainer_cannot_load_ends_it_with_the_permanent_line(redis_server, tmp_path, case):
    model, extra, said = unloadable(case, tmp_path)
    resolved = make_config(redis_server, tmp_path / "checkpoints", processes=1, model=model)
    ended = run_entry(["-m", "rljob_trainer.train"], write_config(resolved, tmp_path / "config.json"),
                      tmp_path / "termination-log", extra, password=redis_server.password)
    assert ended.returncode == 78, ended.stderr[-3000:]
    assert ended.termination.startswith(PERMANENT + said), ended.termination
    assert ended.last_line.endswith(" ERROR rljob_trainer: trainer: " + ended.termination.strip())
    assert not redis_server.client().exists(resolved.keys.progress)  # no start reported: the job stays Starting


@pytest.mark.timeout(300)
def test_under_torchrun_the_ranks_line_is_the_pods_termination_message(redis_server, tmp_path, monkeypatch):
    """Two ranks, both failing: torchrun ends 1 (the code a trainer container exits with), the file holds one line."""
    model, extra, said = unloadable("hub-offline", tmp_path)
    termination = tmp_path / "termination-log"
    termination.write_text("")
    for name, value in {**extra, c.ENV_TERMINATION_LOG: str(termination), c.ENV_ATTEMPT: "0"}.items():
        monkeypatch.setenv(name, value)
    config = write_config(make_config(redis_server, tmp_path / "checkpoints", processes=2, model=model),
                          tmp_path / "config.json")
    trainer = Torchrun(config, 2, free_port(), redis_server.password, tmp_path, "offline")
    assert trainer.wait(240) == 1, trainer.logs()
    trainer.kill()
    text = termination.read_text()
    assert text.startswith(PERMANENT + said) and text.count("\n") == 1, text
    assert permanent(text).startswith(said)
    assert not permanent(trainer.stderr_path.read_text())  # torchrun's own report ends its log, not the line
