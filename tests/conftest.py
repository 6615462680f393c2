import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")  # CPU reference comparisons in true f32

GPU = any(d.platform == "gpu" for d in jax.devices())


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip)


@pytest.fixture
def key(request):
    """A fresh random key per test (seeded from the OS unless NAPKIN_SEED is set), never zeros."""
    seed = int(os.environ.get("NAPKIN_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"NAPKIN_SEED={seed}")
    return jax.random.key(seed)
