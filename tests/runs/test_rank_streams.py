"""``stppo_agent.runs.rank_streams``: every rank's random streams saved and restored."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from stppo_agent.distributed import process_group
from stppo_agent.runs import rank_streams


# -- rank_streams --------------------------------------------------------------------------------------------------
def draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_rank_streams_save_nothing_with_one_process_and_every_ranks_streams_with_several(monkeypatch):
    tensors, json_state = {}, {}
    rank_streams.save(tensors, json_state)
    assert tensors == {} and json_state == {}
    other = {"torch": torch.tensor([9], dtype=torch.uint8), "python": "p1", "numpy": "n1", "cuda": ["c1"]}
    gathered = []
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: gathered.append(local) or [local, other])
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    rank_streams.save(tensors, json_state)
    local = gathered[0]
    assert set(local) == {"torch", "python", "numpy"}  # no CUDA here
    assert torch.equal(local["torch"], torch.get_rng_state())
    assert local["python"] == json.loads(json.dumps(rank_streams.jsonable(random.getstate())))
    assert local["numpy"][1]["dtype"] == "uint32"
    assert [sorted(entry) for entry in tensors["rank_rng"]] == [["torch"], ["cuda", "torch"]]
    assert torch.equal(tensors["rank_rng"][0]["torch"], local["torch"]) and tensors["rank_rng"][1]["cuda"] == ["c1"]
    assert json_state["rank_rng"] == [{"python": local["python"], "numpy": local["numpy"]},
                                      {"python": "p1", "numpy": "n1"}]


def test_rank_streams_restore_this_ranks_entry_or_start_a_fresh_stream(monkeypatch):
    def state_of(seed):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        return ({"torch": torch.get_rng_state()},
                {"python": rank_streams.jsonable(random.getstate()),
                 "numpy": rank_streams.jsonable(np.random.get_state())})

    saved = [state_of(s) for s in (10, 11, 12)]
    expected = {}
    for seed in (10, 11, 12):
        state_of(seed)
        expected[seed] = draws()
    tensors = {"rank_rng": [t for t, _ in saved]}
    json_state = json.loads(json.dumps({"rank_rng": [j for _, j in saved]}))
    notes = []
    run = dict(seed=7, iteration=4, report=notes.append)  # the run this rank resumes

    monkeypatch.setattr(process_group, "rank", lambda: 0)
    state_of(99)
    untouched = draws()
    state_of(99)
    rank_streams.restore(tensors, json_state, **run)
    assert draws() == untouched and notes == []  # rank 0: the caller restores the main entries
    for rank, seed in ((1, 11), (2, 12)):
        monkeypatch.setattr(process_group, "rank", lambda rank=rank: rank)
        state_of(99)
        rank_streams.restore(tensors, json_state, **run)
        assert draws() == expected[seed] and notes == []

    seeded = []
    monkeypatch.setattr(process_group, "seed_everything", seeded.append)
    monkeypatch.setattr(process_group, "rank", lambda: 2)
    fresh = int(np.random.SeedSequence([7, 2, 4]).generate_state(1)[0])
    for short_tensors, short_json, written in ((tensors["rank_rng"][:2], json_state["rank_rng"], 2),
                                               (tensors["rank_rng"], json_state["rank_rng"][:2], 3),
                                               ([], [], 1), (None, None, 1)):
        rank_streams.restore({"rank_rng": short_tensors}, {"rank_rng": short_json}, **run)
        assert seeded[-1] == fresh
        assert notes[-1] == (f"rank 2: the checkpoint holds no random state for this rank (written by {written} "
                             f"process(es)); its sampling continues from a fresh stream (seed {fresh})")
    rank_streams.restore({}, {}, **run)
    assert len(seeded) == 5 and "written by 1 process(es)" in notes[-1]
    rank_streams.restore({}, {}, seed=2**64 + 7, iteration=4, report=notes.append)
    assert seeded[-1] == fresh  # the seed is taken modulo 2**64, as rank_seed does


def test_rank_streams_json_states_round_trip_through_json():
    random.seed(3)
    np.random.seed(3)
    python = json.loads(json.dumps(rank_streams.jsonable(random.getstate())))
    numpy = json.loads(json.dumps(rank_streams.jsonable(np.random.get_state())))
    assert numpy[1]["dtype"] == "uint32" and len(numpy[1]["ndarray"]) == 624
    expected = (random.random(), float(np.random.rand()))
    random.seed(4)
    np.random.seed(4)
    random.setstate(rank_streams.python_state(python))
    np.random.set_state(rank_streams.numpy_state(numpy))
    assert (random.random(), float(np.random.rand())) == expected
    assert rank_streams.jsonable((1, np.array([2], dtype=np.int64), (3,))) == [1, {"ndarray": [2], "dtype": "int64"},
                                                                               [3]]
    assert rank_streams.python_state([3, [1, 2], None]) == (3, (1, 2), None)
    state = rank_streams.numpy_state(["MT19937", {"ndarray": [1, 2], "dtype": "uint32"}, 5, 0, 0.5])
    assert state[0] == "MT19937" and state[1].dtype == np.uint32 and state[1].tolist() == [1, 2]
    assert state[2:] == (5, 0, 0.5)


def test_rank_streams_cuda_streams_travel_when_a_gpu_is_there(monkeypatch):
    set_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["gpu state"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_calls.append)
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, local])
    tensors, json_state = {}, {}
    rank_streams.save(tensors, json_state)
    assert [entry["cuda"] for entry in tensors["rank_rng"]] == [["gpu state"], ["gpu state"]]
    assert sorted(tensors["rank_rng"][1]) == ["cuda", "torch"]

    monkeypatch.setattr(process_group, "rank", lambda: 1)
    run = dict(seed=1, iteration=0, report=print)
    rank_streams.restore({"rank_rng": [{}, {"torch": torch.get_rng_state(), "cuda": ["rank 1 gpu"]}]},
                         json.loads(json.dumps(json_state)), **run)
    assert set_calls == [["rank 1 gpu"]]
    rank_streams.restore({"rank_rng": [{}, {"torch": torch.get_rng_state()}]}, json_state, **run)
    assert len(set_calls) == 1  # written without a GPU: nothing to put back
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rank_streams.restore({"rank_rng": [{}, {"torch": torch.get_rng_state(), "cuda": ["x"]}]}, json_state, **run)
    assert len(set_calls) == 1  # resumed without a GPU
