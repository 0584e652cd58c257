"""POSIX shared-memory segments: safe names, size checks, and sharing with a real second process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.memory.segments import SEGMENT_DIR, check_name, create_segment, open_segment, segment_name


@pytest.fixture
def name():
    made = f"pdt-test-{uuid.uuid4().hex[:12]}"
    yield made
    try:
        os.unlink(os.path.join(SEGMENT_DIR, made))
    except FileNotFoundError:
        pass


def test_segment_names_are_prefixed_safe_and_distinct():
    a = segment_name("prefill[pp0,tp1]", "kv.k.L3")
    assert a.startswith("pdt-prefill-pp0-tp1-kv-k-L3-")
    assert check_name(a) == a
    # ids that fold to the same readable text still get different names
    assert segment_name("a.b", "r") != segment_name("a-b", "r")
    assert segment_name("x", "../../etc/passwd").startswith("pdt-x-etc-passwd-")
    assert len(segment_name("o" * 500, "r" * 500)) <= 200


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "pdt-..-x", ".hidden", "x" * 201, "a b", "naïve"])
def test_unsafe_segment_names_are_refused(bad):
    with pytest.raises(TransportError) as info:
        open_segment(bad, 1)
    assert info.value.code is Reason.SEGMENT_NAME_INVALID


def test_open_refuses_missing_and_short_segments(name):
    with pytest.raises(TransportError) as info:
        open_segment(name, 16)
    assert info.value.code is Reason.SEGMENT_NOT_FOUND
    with create_segment(name, 4096):
        with pytest.raises(TransportError) as info:
            open_segment(name, 8192)
        assert info.value.code is Reason.SEGMENT_TOO_SMALL
        assert "4096" in str(info.value) and "8192" in str(info.value)


def test_create_refuses_an_existing_name(name):
    with create_segment(name, 64):
        with pytest.raises(TransportError) as info:
            create_segment(name, 64)
        assert info.value.code is Reason.SEGMENT_EXISTS


def test_array_and_tensor_share_the_mapping_of_both_openers(name):
    with create_segment(name, 4096) as owner:
        peer = open_segment(name, 4096)
        owner.tensor[10] = 7
        assert peer.array[10] == 7
        peer.array[20:24] = [1, 2, 3, 4]
        assert owner.tensor[20:24].tolist() == [1, 2, 3, 4]
        peer.close()
    assert not os.path.exists(os.path.join(SEGMENT_DIR, name))  # the owner's exit unlinks


def test_close_with_live_views_keeps_them_readable(name):
    segment = create_segment(name, 128)
    view = segment.tensor
    view[0] = 9
    segment.close()
    segment.unlink()
    assert int(view[0]) == 9  # the mapping stays until its last view goes; no fault
    with pytest.raises(TransportError):
        _ = segment.array


def test_a_second_process_writes_into_the_segment_by_name(name):
    with create_segment(name, 1 << 20) as segment:
        child = textwrap.dedent(f"""
            from pd_transfer.memory.segments import open_segment
            with open_segment({name!r}, 1 << 20) as seg:
                seg.array[:] = 0
                seg.array[::4096] = 42
                seg.tensor[1:4] = 7
            """)
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        subprocess.run([sys.executable, "-c", child], check=True, env=env, timeout=60)
        assert (segment.array[::4096] == 42).all()
        assert segment.array[1:4].tolist() == [7, 7, 7]
        assert int(np.count_nonzero(segment.array)) == 256 + 3
        assert os.path.exists(segment.path)  # the child only opened it: its exit unlinks nothing


def test_opening_a_sparse_segment_allocates_none_of_it(name):
    """A sidecar pre-faults a segment only where the worker's pages exist: mapping a
    sparse one (a worker that never filled its pool) must not allocate it."""
    with create_segment(name, 64 << 20) as created:
        opened = open_segment(name)
        try:
            assert os.stat(os.path.join(SEGMENT_DIR, name)).st_blocks == 0
            created.array[:4096] = 1  # the worker touches one page
            assert opened.array[:4096].sum() == 4096
            assert os.stat(os.path.join(SEGMENT_DIR, name)).st_blocks * 512 <= 1 << 20
        finally:
            opened.close()
