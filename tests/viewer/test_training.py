"""The viewer's training pages (issue #40): /training lists the training runs of the
`training_steps` view, /training/RUN draws its reward and loss curves (inline SVG, one
point per step, at the values the view holds) and its steps, through the real app."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.viewer.conftest import HOSTILE, start_viewer
from tests.warehouse.factory import make_episode, record

RUN = "pytest-view-train-env"
TRAINING = "pytest-train-view"


def _warehouse(root: Path) -> None:
    """Two steps of 2 rollouts on one task: step 1 rewards 0 and 1, step 2 both 1."""
    from warehouse import Warehouse

    wh = Warehouse(root)
    wh.write_run(RUN, model="smollm2-135m-instruct", dataset="train", config={})
    w = wh.writer(durability="flush")
    scores, steps = [], []
    for step, rewards in ((1, (0.0, 1.0)), (2, (1.0, 1.0))):
        ids = []
        for k, r in enumerate(rewards):
            ep, turns = make_episode(RUN, "add-1", sample=2 * step + k, answer="5" if r else "4")
            record(w, ep, turns)
            ids.append(ep.episode_id)
            scores.append({"run_id": RUN, "episode_id": ep.episode_id, "verifier": "exact", "score": r,
                           "passed": r == 1.0, "reason": "", "answer": ep.answer, "ground_truth": "5"})
        steps.append({"training_run": TRAINING, "step": step, "policy_version": f"{TRAINING}@{step - 1}",
                      "loss": 0.5 / step, "grad_norm": 1.0, "rollouts": 2, "dropped": 0, "wall_s": 100.0 * step,
                      "episode_ids": ids})
    w.close()
    wh.write_scores(scores)
    wh.write_train_steps(RUN, steps)
    # a hostile training run name: text on the page, never markup
    wh.write_train_steps(RUN, [{"training_run": HOSTILE[:60], "step": 1, "rollouts": 0, "dropped": 0,
                                "episode_ids": []}])
    wh.finish_run(RUN)


def test_the_training_pages_show_the_curve_and_the_steps(tmp_path: Path) -> None:
    _warehouse(tmp_path / "wh")
    srv = start_viewer(tmp_path / "wh")
    try:
        listing = httpx.get(srv.url + "/training")
        assert listing.status_code == 200
        assert f'href="/training/{TRAINING}"' in listing.text
        assert "<script>window.__pwned" not in listing.text and "&lt;script&gt;" in listing.text
        row = re.search(rf">{TRAINING}</a></td><td>(\d+)</td>\s*<td>([\d.]+)</td>\s*<td>(\d+) of (\d+)</td>", listing.text)
        assert row and row.groups() == ("2", "0.750", "1", "2"), listing.text  # mean of 0.5 and 1.0; 1 group of 2 with a spread

        page = httpx.get(srv.url + f"/training/{TRAINING}")
        assert page.status_code == 200
        html = page.text
        for testid in ("reward-curve", "loss-curve", "training-steps"):
            assert f'data-testid="{testid}"' in html
        reward = html.split('data-testid="reward-curve"')[1].split("</figure>")[0]
        assert [int(s) for s in re.findall(r'<circle [^>]*data-step="(\d+)"', reward)] == [1, 2]
        assert "step 1: 0.5<" in reward and "step 2: 1<" in reward  # the view's verifier rewards
        ys = [float(y) for y in re.findall(r'<circle cx="[\d.]+" cy="([\d.]+)"', reward)]
        assert ys[1] < ys[0]  # a higher reward is drawn higher
        assert "<polygon" in reward  # the spread band
        loss = html.split('data-testid="loss-curve"')[1].split("</figure>")[0]
        assert "step 1: 0.5<" in loss and "step 2: 0.25<" in loss
        assert re.findall(r'<tr data-step="(\d+)">', html) == ["1", "2"]
        assert f'href="/runs/{RUN}"' in html  # the rollouts' run

        missing = httpx.get(srv.url + "/training/no-such-run")
        assert missing.status_code == 404 and "has no steps" in missing.text
    finally:
        srv.stop()
