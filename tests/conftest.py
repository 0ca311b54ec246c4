
import pytest

import local_launch

# Ranks are forked from one process that imported torch and deepspeed once (local_launch.preload): a
# launch's ranks then skip 3-5 s of imports each, most of a small test launch on two cores.
local_launch.preload()


@pytest.fixture(autouse=True)
def _multiprocess_tests_are_marked(request, monkeypatch):
    """The fast tier (`-m "not multiprocess"`) stays fast: a test that launches ranks must say so."""
    if request.node.get_closest_marker("multiprocess") is None:
        import local_launch

        def refuse(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} launches processes: mark it @pytest.mark.multiprocess")
        # every launch() asks for a port first, however the test imported launch
        monkeypatch.setattr(local_launch, "free_port", refuse)


@pytest.fixture(scope="session", autouse=True)
def _launches_leave_no_shared_memory():
    """No launch of the session left DeepSpeed's shared-memory buffers in /dev/shm (local_launch removes
    those of each launch's port, whatever became of its ranks)."""
    yield
    import local_launch
    left = [path for port in local_launch.PORTS for path in local_launch.shm_buffers(port)]
    assert not left, f"launches left shared memory behind: {left}"


@pytest.fixture(scope="session")
def sgd_config(tmp_path_factory):
    """sgd_config(zero=1, clip=0.0): a ds_config.json for the equivalence tests (tests/training.py)."""
    from training import write_sgd_config
    made = {}

    def config(zero=1, clip=0.0):
        if (zero, clip) not in made:
            made[(zero, clip)] = write_sgd_config(tmp_path_factory.mktemp("cfg") / f"sgd-zero{zero}-clip{clip}.json",
                                                  zero, clip)
        return made[(zero, clip)]
    return config


@pytest.fixture(scope="session")
def references(sgd_config, tmp_path_factory):
    """references(micro_batches, model, clip, zero): the same training on one rank, without a pipeline (cached)."""
    from training import TINY, train
    made = {}

    def reference(micro_batches=8, model=TINY, clip=0.0, zero=1):
        key = (micro_batches, tuple(model), clip, zero)
        if key not in made:
            made[key] = train(tmp_path_factory.mktemp("ref"), 1, ["--pipeline-parallel-size", "0"],
                              sgd_config(zero=zero, clip=clip), micro_batches, model=model)
        return made[key]
    return reference
