import numpy as np
import torch

from ditq.demo.scenes import (
    CANVAS,
    REFERENCE_CANVAS,
    TASK_KINDS,
    Scene,
    SceneObject,
    render_scenes,
    sample_task,
)


def test_tasks_are_seeded():
    first = [sample_task(np.random.default_rng(3), *kind) for kind in TASK_KINDS]
    second = [sample_task(np.random.default_rng(3), *kind) for kind in TASK_KINDS]
    assert first == second


def test_task_layouts_and_counts():
    rng = np.random.default_rng(0)
    for kind, refs in TASK_KINDS:
        task = sample_task(rng, kind, refs)
        assert len(task.references) == refs
        assert all(ref.background is None and ref.canvas == REFERENCE_CANVAS for ref in task.references)
        assert task.target.canvas == CANVAS and task.target.background == task.expectation.background
        assert sum(task.expectation.objects.values()) == len(task.target.objects)
        assert 1 <= len(task.target.objects) <= 4


def test_render_paints_objects_on_background():
    scene = Scene("white", (SceneObject("square", "red", (20.0, 20.0), 16.0),))
    sprite = Scene(None, (SceneObject("circle", "blue", (16.0, 16.0), 20.0),), REFERENCE_CANVAS)
    image = render_scenes([scene])[0]
    assert torch.allclose(image[:, 20, 20], torch.tensor([220, 40, 40, 255]) / 127.5 - 1)
    assert torch.allclose(image[:, 50, 50], torch.tensor([245, 245, 245, 255]) / 127.5 - 1)
    ref = render_scenes([sprite])[0]
    assert ref[3, 16, 16] == 1.0 and ref[3, 0, 0] == -1.0  # opaque object, transparent elsewhere
