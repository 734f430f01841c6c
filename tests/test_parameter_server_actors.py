"""Actors and a learner (dtcourse.parameter_server.actor_learner): the cart-pole, the protocol, staleness, learning.

The protocol tests run 3 actors for 200 steps each with a short warm-up (about 1 s a launch); the
learning test runs the lesson's configuration once (a few seconds: it has to learn something).
"""

from __future__ import annotations

import math

import pytest
import torch

from dtcourse.parameter_server.actor_learner import ROW, ActorLearnerConfig, act_and_learn, greedy_return
from dtcourse.parameter_server.cartpole import ANGLE_LIMIT, CartPole

SMALL = ActorLearnerConfig(num_actors=3, steps=200, push_every=10, pull_every=40, updates_per_push=2,
                           warmup=100, batch=32)


# --------------------------------------------------------------------------- #
# The environment
# --------------------------------------------------------------------------- #
def test_cartpole_physics_and_episode_ends():
    env = CartPole(seed=3)
    state = env.reset()
    assert all(abs(v) <= 0.05 for v in state)
    # Always pushing right: the cart accelerates right, so the pole falls left (theta decreases),
    # and the episode ends on the angle well before the 200-step cut-off.
    for t in range(200):
        state, reward, terminal, truncated = env.step(1)
        assert reward == 1.0 and not truncated
        if terminal:
            break
    assert terminal and t < 30 and state[1] > 0 and state[2] < -ANGLE_LIMIT
    # One Euler step from rest, upright, pushing right with 10 N (cart 1 kg, pole 0.1 kg, half-length 0.5 m):
    # the equations of Barto et al. at theta = 0 give these accelerations; positions move only a step later.
    env.state = (0.0, 0.0, 0.0, 0.0)
    state, *_ = env.step(1)
    temp = 10.0 / 1.1
    theta_acc = -temp / (0.5 * (4 / 3 - 0.1 / 1.1))
    x_acc = temp - 0.1 * 0.5 * theta_acc / 1.1
    assert state[0] == state[2] == 0.0
    assert math.isclose(state[1], 0.02 * x_acc, rel_tol=1e-12) and math.isclose(state[3], 0.02 * theta_acc, rel_tol=1e-12)


def test_cartpole_truncates_a_balanced_pole_at_max_steps():
    env = CartPole(seed=0, max_steps=5)
    env.reset()
    env.state = (0.0, 0.0, 0.0, 0.0)
    outcomes = [env.step(t % 2)[2:] for t in range(5)]           # alternate pushes: stays up
    assert outcomes[:4] == [(False, False)] * 4 and outcomes[4] == (False, True)


def test_config_checks_itself():
    with pytest.raises(ValueError, match="pull_every=15 must be a multiple of push_every=10"):
        ActorLearnerConfig(pull_every=15)
    with pytest.raises(ValueError, match="push_every=7 must divide steps=1000"):
        ActorLearnerConfig(push_every=7, pull_every=7)
    with pytest.raises(ValueError, match="num_actors must be an integer >= 1"):
        ActorLearnerConfig(num_actors=0)
    assert [round(ActorLearnerConfig(num_actors=3).epsilon(i), 4) for i in range(3)] == [0.4, 0.0162, 0.0007]
    assert ActorLearnerConfig(num_actors=3, pull_every=40, push_every=10, updates_per_push=2).staleness_bound == 22


# --------------------------------------------------------------------------- #
# The protocol
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def small_run():
    return act_and_learn(SMALL)


def test_who_sends_what_to_whom(small_run):
    cfg, run = SMALL, small_run
    P = sum(p.numel() for p in cfg.q_network().parameters())
    links = run.link_bytes()
    pushes = cfg.steps // cfg.push_every
    pulls = cfg.steps // cfg.pull_every            # the first (step 0) and one every pull_every, none at the end
    for a in range(1, cfg.world_size):
        assert links[a, 0] == pushes * cfg.push_every * ROW * 4          # experience: actors -> learner only
        assert links[0, a] == pulls * P * 4                              # parameters: learner -> actors only
    assert set(links) == {(a, 0) for a in range(1, 4)} | {(0, a) for a in range(1, 4)}   # actors never talk
    phases = {(m.src, m.phase) for t in run.actors for m in t.counter.messages}
    assert phases == {(a, p) for a in range(1, 4) for p in ("header", "experience")}
    assert {m.phase for m in run.learner.counter.messages} == {"header", "params"}


def test_versions_pulls_and_staleness(small_run):
    cfg, run = SMALL, small_run
    for trace in run.actors:
        steps = [s for s, _ in trace.pulls]
        assert steps == list(range(0, cfg.steps, cfg.pull_every))           # pulls at 0, 40, 80, ...
        versions = [v for _, v in trace.pulls]
        assert versions[0] == 0 and versions == sorted(versions)            # versions only move forward
    # Every push arrives in round-robin order, and the learner's version only grows.
    assert [(a, s) for a, s, _ in run.learner.arrivals] == [(a, s) for s in range(10, 201, 10) for a in range(3)]
    on_arrival = [v for _, _, v in run.learner.arrivals]
    assert on_arrival == sorted(on_arrival)
    # U updates after every push that leaves at least `warmup` transitions in the replay.
    learning = sum(1 for i in range(len(on_arrival)) if (i + 1) * cfg.push_every >= cfg.warmup)
    assert run.learner.version == len(run.learner.losses) == cfg.updates_per_push * learning
    # Staleness: bounded by the pull period, and the bound is reached once learning has started.
    late = run.staleness()
    assert len(late) == cfg.num_actors * cfg.steps and min(late) >= 0
    assert max(late) == cfg.staleness_bound


def test_staleness_grows_with_the_pull_period():
    rare = act_and_learn(ActorLearnerConfig(**{**SMALL.__dict__, "pull_every": 100}))
    assert max(rare.staleness()) == rare.config.staleness_bound == (3 * 10 - 1) * 2
    assert max(rare.staleness()) > SMALL.staleness_bound


def test_a_run_is_reproducible(small_run):
    again = act_and_learn(SMALL)
    assert torch.equal(again.params, small_run.params)      # round robin: the same order, the same bits
    assert again.returns() == small_run.returns()


# --------------------------------------------------------------------------- #
# Learning
# --------------------------------------------------------------------------- #
def test_learning_improves_the_return():
    cfg = ActorLearnerConfig()                    # the lesson's run: 3 actors, 1000 steps each, pull every 10
    run = act_and_learn(cfg)
    before = greedy_return(cfg, run.learner.snapshots[0][2])
    after = greedy_return(cfg, run.params)
    assert before < 30 and after > 3 * before, (before, after)
