"""``import_into`` imports again once when containerd's garbage collector removed a parent layer snapshot under the
import (the message ``ctr`` gives then, seen on a node whose kept containerd root held the image's earlier version),
and fails with ctr's message on any other error. ``ctr`` itself is replaced here: its boundary is the command line."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from rljob_localcluster import images as img

RACE = ('ctr: failed to prepare extraction snapshot "extract-1 sha256:07ca": parent snapshot sha256:d768 does not '
        'exist: not found')


def archive(tmp_path) -> img.Image:
    path = tmp_path / "trainer.tar"
    with tarfile.open(path, "w") as tar:
        data = json.dumps({"manifests": [{"digest": "sha256:abc"}]}).encode()
        info = tarfile.TarInfo("index.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return img.Image("trainer-cpu", "docker.io/rljob/trainer-cpu:0.1.0", path, "h", 1, 1)


@pytest.mark.parametrize("first_error, imported", [(RACE, True), ("ctr: disk full", False)])
def test_one_retry_after_a_removed_parent_snapshot_and_none_after_other_errors(tmp_path, monkeypatch, first_error,
                                                                              imported):
    image = archive(tmp_path)
    calls, have = [], {}
    monkeypatch.setattr(img, "IMPORT_RETRY_S", 0.0)

    def ctr(socket, *args, timeout=60):
        calls.append(args[:2])
        if len(calls) == 1:
            return subprocess.CompletedProcess(args, 1, "", first_error)
        have[image.name] = "sha256:abc"
        return subprocess.CompletedProcess(args, 0, "unpacked", "")

    monkeypatch.setattr(img, "ctr", ctr)
    monkeypatch.setattr(img, "present", lambda socket, timeout=60: dict(have))
    logged = []
    if imported:
        assert img.import_into("/run/sock", [image], log=logged.append) == [image.name]
        assert calls == [("images", "import")] * 2 and "importing docker.io/rljob/trainer-cpu:0.1.0 again" in logged[1]
    else:
        with pytest.raises(RuntimeError, match="ctr: disk full"):
            img.import_into("/run/sock", [image])
        assert calls == [("images", "import")]
