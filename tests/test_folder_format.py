"""The shared-folder format, pinned byte for byte (docs/design.md §5): the names and bytes the real agent transport
writes. A change here is a change of the wire contract between agent and server releases: make it on purpose
(a new FOLDER_MAGIC), not by accident."""
from __future__ import annotations

import os

import pytest
import torch

from npu_agent.records import PendingRecord
from npu_agent.snapshot import snapshot
from npu_agent.transport import Counts, Refusal, end_frame
from npu_agent.transport_folder import FolderTransport
from protos import codec, folder_format
from protos import online_check_pb2 as pb
from protos.folder_format import (
    END_FILE,
    FOLDER_MAGIC,
    FRAME_LENGTH,
    RANK_DIR,
    RECORD_FILE,
    folder_end_name,
    folder_record_name,
    parse_end_name,
    parse_rank_dir,
    parse_record_name,
    rank_dir_name,
)

RUN = "run0123456789abcd"

# Record 5 of run RUN on rank 3 (world size 4), step 2: Functional.relu.0 of the float32 tensor [-1, 2], as
# FolderTransport writes it: magic, one frame length (0xbb), the Frame (Record header, tensor table, values) whose
# `data` field (0x7a, 72 bytes) holds the two tensors at 64-byte aligned offsets.
RECORD_HEX = (
    "4f434652414d4531" "bb000000"
    "0a6f0a2e0a1172756e30313233343536373839616263641003180220052a1146756e6374696f6e616c2e72656c752e30300112130a07"
    "666c6f6174333212010228083a0363707512150a07666c6f61743332120102204028083a03637075184822040a0230002a0032023001"
    "42008001017a48"
    "000080bf00000040" + "00" * 56 + "0000000000000040"
)
# The end marker after 6 records captured, sent and acknowledged (last_seq 6): magic, length 0x21, one End Frame.
END_HEX = "4f434652414d4531" "21000000" "1a1f0a1172756e3031323334353637383961626364100318062006280638064004"


class Events:
    def __init__(self) -> None:
        self.acks: list[tuple[int, str, str]] = []

    def on_ack(self, seq: int, status: str, reason: str, count: int = 1) -> None:
        self.acks += [(s, status, reason) for s in range(seq, seq + count)]

    def on_reconnect(self, generation: int) -> None:
        pass

    def on_refused(self, refusal: Refusal) -> None:
        raise AssertionError(refusal)


@pytest.fixture
def one_thread():
    """The record carries the intra-op thread count (replay uses the same); pin it for the bytes to be fixed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def written(tmp_path, one_thread):
    transport = FolderTransport(str(tmp_path), RUN, 3, 4)
    events = Events()
    transport.start(events)
    x = torch.tensor([-1.0, 2.0])
    rec = PendingRecord(name="Functional.relu.0", step=2, inputs=snapshot(((x,), {})), output=snapshot(torch.relu(x)),
                        seq=5)
    assert transport.send_records([rec], 1)
    assert transport.send_end(end_frame(transport.identity, Counts(captured=6, sent=6, acknowledged=6), 6), 5.0)
    assert events.acks == [(5, "ACCEPTED", "")]
    return tmp_path / "rank3"


def test_the_agent_writes_exactly_these_names(written):
    assert sorted(os.listdir(written)) == ["run0123456789abcd.rank3.000000000005.rec", "run0123456789abcd.rank3.end"]
    assert written.name == rank_dir_name(3) == "rank3"


def test_a_record_file_is_exactly_these_bytes(written):
    data = (written / "run0123456789abcd.rank3.000000000005.rec").read_bytes()
    assert data.hex() == RECORD_HEX, f"the record file format changed:\n{data.hex()}"


def test_the_end_marker_is_exactly_these_bytes(written):
    data = (written / "run0123456789abcd.rank3.end").read_bytes()
    assert data.hex() == END_HEX, f"the end marker's format changed:\n{data.hex()}"


def test_the_pinned_bytes_mean_what_the_comments_say():
    data = bytes.fromhex(RECORD_HEX)
    assert data[:8] == FOLDER_MAGIC == b"OCFRAME1"
    (n,) = FRAME_LENGTH.unpack_from(data, 8)
    assert 12 + n == len(data)
    frame = pb.Frame.FromString(data[12:])
    h = frame.record.header
    assert (h.run_id, h.rank, h.step, h.seq, h.name) == (RUN, 3, 2, 5, "Functional.relu.0")
    assert frame.record.intra_op_threads == 1 and frame.record.payload_bytes == len(frame.data) == 72
    assert [(m.dtype, list(m.shape), m.offset) for m in frame.record.tensors] == [("float32", [2], 0),
                                                                                  ("float32", [2], 64)]
    assert torch.equal(torch.frombuffer(bytearray(frame.data[64:72]), dtype=torch.float32), torch.tensor([0.0, 2.0]))
    end = bytes.fromhex(END_HEX)
    assert end[:8] == FOLDER_MAGIC and FRAME_LENGTH.unpack_from(end, 8) == (len(end) - 12,)
    e = pb.Frame.FromString(end[12:]).end
    assert (e.run_id, e.rank, e.captured, e.sent, e.acknowledged, e.dropped, e.last_seq, e.world_size) == (
        RUN, 3, 6, 6, 6, 0, 6, 4)


def test_names_are_built_and_parsed_by_one_module():
    assert folder_record_name(RUN, 0, 0) == "run0123456789abcd.rank0.000000000000.rec"
    assert folder_record_name("a", 999999999, 999999999999) == "a.rank999999999.999999999999.rec"
    assert folder_end_name("r-_1", 12) == "r-_1.rank12.end"
    assert parse_record_name(folder_record_name(RUN, 7, 42)) == (RUN, 7, 42)
    assert parse_end_name(folder_end_name(RUN, 7)) == (RUN, 7)
    assert parse_rank_dir("rank0") == 0 and parse_rank_dir("rank31") == 31
    # the names protos.codec re-exports (for importers not yet moved) are these very objects
    assert codec.folder_record_name is folder_record_name and codec.folder_end_name is folder_end_name
    assert codec.FOLDER_MAGIC is FOLDER_MAGIC


@pytest.mark.parametrize("name", [
    "run.rank0.000000000001.rec\n",            # `$` would accept a trailing newline
    "run.rank0.00000000000\u0661.rec",         # ARABIC-INDIC DIGIT ONE: `\d` would accept it
    "run.rank\u0663.000000000001.rec",
    "run.rank03.000000000001.rec",             # the agent never writes a leading zero
    "run.rank0.00000000001.rec",               # 11 digits
    "run.rank0.0000000000001.rec",             # 13 digits
    "run.rank1234567890.000000000001.rec",     # rank beyond 9 digits
    "ru n.rank0.000000000001.rec", "../x.rank0.000000000001.rec", "run/x.rank0.000000000001.rec",
    "r\u00e9n.rank0.000000000001.rec",         # non-ASCII letter in the run id
    "x" * 65 + ".rank0.000000000001.rec",      # run id over 64 characters
    ".run.rank0.000000000001.rec", "run.rank0.000000000001.rec.tmp", "run.rank0.000000000001.REC",
    "run.rank-1.000000000001.rec", "run.rank0.-00000000001.rec", "run.rank0.000000000001.rec\x00",
])
def test_record_names_the_agent_never_writes_do_not_parse(name):
    assert parse_record_name(name) is None
    assert RECORD_FILE.match(name) is None and RECORD_FILE.fullmatch(name) is None


@pytest.mark.parametrize("name", ["run.rank0.end\n", "run.rank00.end", "run.rank\u0660.end", "run.rank0.end.tmp",
                                  ".rank0.end", "run.rank0.END", "run.rank0.000000000001.end"])
def test_end_names_the_agent_never_writes_do_not_parse(name):
    assert parse_end_name(name) is None and END_FILE.match(name) is None


@pytest.mark.parametrize("name", ["rank", "rank01", "rank0\n", "rank\u0661", "Rank0", "rank-1", "rank0x",
                                  "rank1234567890"])
def test_rank_folders_the_agent_never_makes_do_not_parse(name):
    assert parse_rank_dir(name) is None and RANK_DIR.match(name) is None


@pytest.mark.parametrize("run, rank, seq", [(RUN, 0, 0), ("A", 1, 10), ("x" * 64, 999999999, folder_format.MAX_SEQ),
                                            ("a_b-C", 40, 123456789012)])
def test_every_name_that_parses_is_rebuilt_exactly(run, rank, seq):
    record, end = folder_record_name(run, rank, seq), folder_end_name(run, rank)
    assert parse_record_name(record) == (run, rank, seq)
    assert folder_record_name(*parse_record_name(record)) == record
    assert folder_end_name(*parse_end_name(end)) == end
    assert parse_rank_dir(rank_dir_name(rank)) == rank


@pytest.mark.parametrize("run", [RUN, "a", "A_b-9", "x" * 64, "x" * 65, "", "a.b", "a b", "a\n", "r\u00e9n", "a/b",
                                 "\u0661"])
def test_a_run_id_is_valid_in_a_file_name_exactly_when_the_intake_accepts_it(run):
    import re

    from protos.limits import RUN_ID

    in_name = parse_record_name(folder_record_name(run, 0, 0)) == (run, 0, 0)
    assert in_name == bool(re.fullmatch(folder_format.RUN_ID_PATTERN, run, re.ASCII)) == bool(RUN_ID.match(run))
