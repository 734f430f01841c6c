"""Actors and a learner, after Gorila and Ape-X: experience flows to the owner of the parameters.

Gorila (Nair et al., "Massively Parallel Methods for Deep Reinforcement Learning", arXiv:1507.04296)
and Ape-X (Horgan et al., "Distributed Prioritized Experience Replay", arXiv:1803.00933) split
reinforcement learning the way a parameter server splits supervised training. Here, as in Ape-X,
rank 0 is the **learner**: it owns the Q-network's parameters, its optimizer and the replay memory.
Ranks 1..A are **actors**: each plays its own cart-pole (``cartpole.py``) with a copy of the network
and never computes a gradient. Two kinds of message travel, counted with lesson 01's ``ByteCounter``:

* actor -> learner, every ``push_every`` steps, a **push** of experience: a header
  ``[actor, step, wants_pull]`` and a chunk of transitions, one row each,
  ``(s, a, r, s', terminal, version)``; ``version`` is the learner version of the network that chose a;
* learner -> actor, every ``pull_every`` steps, a **pull** answered: ``[version]`` and the parameters.
  The learner speaks first, so every actor starts from version 0.

The learner takes the actors' pushes in turn (round robin), appends each chunk to the replay, then
runs ``updates_per_push`` DQN updates (Mnih et al. 2015, with the double-DQN target of van Hasselt
et al., arXiv:1509.06461); each update adds one to its **version**. The fixed order makes a run
reproducible however busy the machine is. (Ape-X's learner takes whatever has arrived; here a slow
actor holds the others up, as a straggler holds up lesson 03's synchronous server.)

The **staleness** of a transition is the learner's version when the transition reaches the replay
minus the version that acted: how many updates behind the learner the actor's policy was. An
actor refreshes its copy every K = pull_every / push_every pushes, so with A actors and U updates
per push it lags by at most (A·K - 1)·U updates (``ActorLearnerConfig.staleness_bound``): bounded by
the pull period, as SSP bounds a worker's lead by s. Unlike a parameter server's stale *gradient*,
a stale *policy* only changes which experience is collected; Q-learning learns off-policy, so the
update itself is never stale. That is Ape-X's argument for sending experience rather than gradients.

Exploration is Ape-X's: actor i acts epsilon_i-greedily, epsilon_i = 0.4^(1 + 7 i / (A - 1)), so one
actor explores a lot and the others little. Replay is uniform and keeps everything (Ape-X
prioritises by TD error and holds millions of transitions).

    run = act_and_learn(ActorLearnerConfig(num_actors=3, steps=1000, pull_every=10))
    run.staleness(), run.returns(), greedy_return(run.config, run.params)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dtcourse.collectives import ByteCounter
from dtcourse.models import MLP
from dtcourse.parameter_server.cartpole import CartPole, play_greedy
from dtcourse.parameter_server.messages import _isend, _recv
from dtcourse.runtime.launch import launch

__all__ = ["ActorLearnerConfig", "ActorTrace", "LearnerResult", "ActorLearnerRun", "run_actor", "run_learner",
           "act_and_learn", "greedy_return", "ROW"]

ROW = 12                                   # s (4), a, r, s' (4), terminal, version: one transition
TAG_PUSH, TAG_EXPERIENCE, TAG_REPLY, TAG_PARAMS = 11, 12, 13, 14


@dataclass(frozen=True)
class ActorLearnerConfig:
    """Who acts, how often they push and pull, and the learner's DQN settings. Checks itself."""

    # The defaults learn cart-pole from 3,000 transitions and 540 updates (a couple of seconds):
    # a short horizon (gamma 0.95) and a quick Adam spread the value of staying up in few updates.
    num_actors: int = 3
    steps: int = 1000            # environment steps per actor
    push_every: int = 10         # steps per chunk of experience pushed
    pull_every: int = 10         # steps between an actor's pulls: a multiple of push_every
    updates_per_push: int = 2    # U: the learner's DQN updates after each chunk
    batch: int = 64
    lr: float = 3e-3
    gamma: float = 0.95
    target_every: int = 50       # updates between copies of the online network into the target
    warmup: int = 300            # transitions in replay before the first update
    hidden: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        name = "ActorLearnerConfig"
        for key in ("num_actors", "steps", "push_every", "pull_every", "updates_per_push", "batch",
                    "target_every", "hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {key} must be an integer >= 1, got {value!r}.")
        if self.steps % self.push_every:
            raise ValueError(f"{name}: push_every={self.push_every} must divide steps={self.steps}, so every "
                             "push carries the same number of transitions.")
        if self.pull_every % self.push_every:
            raise ValueError(f"{name}: pull_every={self.pull_every} must be a multiple of push_every="
                             f"{self.push_every}: an actor asks for parameters along with a push.")
        if not (self.lr > 0 and 0 <= self.gamma < 1 and self.warmup >= 0):
            raise ValueError(f"{name}: need lr > 0, 0 <= gamma < 1 and warmup >= 0, got lr={self.lr!r}, "
                             f"gamma={self.gamma!r}, warmup={self.warmup!r}.")

    @property
    def world_size(self) -> int:
        return self.num_actors + 1

    @property
    def staleness_bound(self) -> int:
        """(A·K - 1)·U: the most updates an actor's policy can lag when its pushes reach the replay."""
        return (self.num_actors * self.pull_every // self.push_every - 1) * self.updates_per_push

    def epsilon(self, actor: int) -> float:
        """Ape-X's exploration: 0.4^(1 + 7 i / (A - 1)) for actor i."""
        return 0.4 ** (1 + 7 * actor / max(self.num_actors - 1, 1))

    def q_network(self) -> MLP:
        return MLP((CartPole.observation_size, self.hidden, self.hidden, CartPole.num_actions), seed=self.seed)


def _greedy(net: MLP, state) -> int:
    with torch.no_grad():
        return int(net(torch.tensor(state).unsqueeze(0)).argmax())      # (1, 4) -> (1, 2) -> action


# --------------------------------------------------------------------------- #
# An actor
# --------------------------------------------------------------------------- #
@dataclass
class ActorTrace:
    """What actor ``actor`` did: its finished episodes and its pulls."""

    actor: int
    episodes: list[tuple[int, float, int]] = field(default_factory=list)   # (step it ended at, return, version)
    pulls: list[tuple[int, int]] = field(default_factory=list)             # (step, version received)
    counter: ByteCounter = field(default_factory=ByteCounter)


def _receive_params(net: MLP, group, counter: ByteCounter) -> int:
    header = torch.empty(1, dtype=torch.int64)                                    # [version]
    flat = parameters_to_vector(net.parameters()).detach()                        # (P,)
    _recv(header, 0, TAG_REPLY, group, counter, None)
    _recv(flat, 0, TAG_PARAMS, group, counter, None)                              # receives P * 4 bytes
    vector_to_parameters(flat, net.parameters())
    return int(header[0])


def run_actor(config: ActorLearnerConfig, group=None) -> ActorTrace:
    """Actor i (rank i + 1): act epsilon-greedily, push every ``push_every`` steps, pull every ``pull_every``."""
    i = dist.get_rank(group) - 1
    trace = ActorTrace(i)
    net = config.q_network()
    version = _receive_params(net, group, trace.counter)       # the learner speaks first: version 0
    trace.pulls.append((0, version))
    env, rng, epsilon = CartPole(seed=1000 * config.seed + i), random.Random(config.seed + 7919 * i), config.epsilon(i)
    state, episode_return = env.reset(), 0.0
    rows, sends = [], []
    for t in range(config.steps):
        action = rng.randrange(2) if rng.random() < epsilon else _greedy(net, state)
        after, reward, terminal, truncated = env.step(action)
        rows.append((*state, action, reward, *after, float(terminal), version))
        episode_return += reward
        state = after
        if terminal or truncated:
            trace.episodes.append((t + 1, episode_return, version))
            state, episode_return = env.reset(), 0.0
        if (t + 1) % config.push_every == 0:
            pull = (t + 1) % config.pull_every == 0 and t + 1 < config.steps
            header = torch.tensor([i, t + 1, int(pull)])                          # [actor, step, wants_pull]
            chunk = torch.tensor(rows, dtype=torch.float32)                       # (push_every, ROW)
            sends += [_isend(header, 0, TAG_PUSH, group, trace.counter, "header", t + 1, -1),
                      _isend(chunk, 0, TAG_EXPERIENCE, group, trace.counter, "experience", t + 1, -1)]
            rows = []
            if pull:
                version = _receive_params(net, group, trace.counter)
                trace.pulls.append((t + 1, version))
    for work in sends:
        work.wait()
    return trace


# --------------------------------------------------------------------------- #
# The learner
# --------------------------------------------------------------------------- #
@dataclass
class LearnerResult:
    """What the learner recorded. ``arrivals`` has one row per push: (actor, step, version on arrival)."""

    params: torch.Tensor                                  # (P,) final parameters
    version: int
    arrivals: list[tuple[int, int, int]]
    staleness: list[list[int]]                            # per push: each transition's staleness
    snapshots: list[tuple[int, int, torch.Tensor]]        # (transitions received, version, params)
    losses: list[float]
    counter: ByteCounter


class _Learner:
    """Rank 0's state: the online and target networks, Adam, the replay memory and the version."""

    def __init__(self, config: ActorLearnerConfig, group):
        self.config, self.group = config, group
        self.net, self.target = config.q_network(), config.q_network()
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=config.lr)
        self.replay = torch.empty(config.num_actors * config.steps, ROW)          # (capacity, ROW)
        self.size, self.version = 0, 0
        self.generator = torch.Generator().manual_seed(config.seed)
        self.counter, self.losses, self._sends = ByteCounter(), [], []

    def reply(self, actor: int) -> None:
        """Send actor ``actor`` the current parameters and their version: a pull answered."""
        flat = parameters_to_vector(self.net.parameters()).detach().clone()      # (P,) a snapshot
        header = torch.tensor([self.version])
        self._sends += [  # sends P * 4 bytes to the actor
            _isend(header, actor + 1, TAG_REPLY, self.group, self.counter, "header", self.version, -1),
            _isend(flat, actor + 1, TAG_PARAMS, self.group, self.counter, "params", self.version, -1)]

    def update(self) -> None:
        """One double-DQN step on a uniform sample of the replay; the version goes up by one."""
        cfg = self.config
        batch = self.replay[torch.randint(self.size, (cfg.batch,), generator=self.generator)]   # (B, ROW)
        s, a, r, after, terminal = batch[:, :4], batch[:, 4].long(), batch[:, 5], batch[:, 6:10], batch[:, 10]
        q = self.net(s).gather(1, a[:, None]).squeeze(1)                                        # (B,)
        with torch.no_grad():
            best = self.net(after).argmax(1, keepdim=True)              # (B, 1) chosen by the online net
            target = r + cfg.gamma * (1 - terminal) * self.target(after).gather(1, best).squeeze(1)
        loss = F.smooth_l1_loss(q, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.version += 1
        self.losses.append(loss.item())
        if self.version % cfg.target_every == 0:
            self.target.load_state_dict(self.net.state_dict())


def run_learner(config: ActorLearnerConfig, group=None, snapshot_every: int = 10) -> LearnerResult:
    """Rank 0: answer the first pulls, then take every actor's pushes in turn, learning after each."""
    cfg, me = config, _Learner(config, group)
    arrivals, staleness, snapshots = [], [], []
    for actor in range(cfg.num_actors):
        me.reply(actor)                                                # version 0 for everyone
    for push in range(cfg.steps // cfg.push_every):
        for actor in range(cfg.num_actors):
            header = torch.empty(3, dtype=torch.int64)                 # [actor, step, wants_pull]
            chunk = torch.empty(cfg.push_every, ROW)                   # (push_every, ROW)
            _recv(header, actor + 1, TAG_PUSH, group, me.counter, None)
            _recv(chunk, actor + 1, TAG_EXPERIENCE, group, me.counter, None)
            sender, step, wants_pull = header.tolist()
            if (sender, step) != (actor, (push + 1) * cfg.push_every):
                raise RuntimeError(f"learner expected actor {actor}'s push of step {(push + 1) * cfg.push_every}, "
                                   f"got actor {sender}'s of step {step}")
            me.replay[me.size:me.size + cfg.push_every] = chunk
            me.size += cfg.push_every
            arrivals.append((actor, step, me.version))
            staleness.append([me.version - int(v) for v in chunk[:, -1].tolist()])
            if me.size >= cfg.warmup:
                for _ in range(cfg.updates_per_push):
                    me.update()
            if wants_pull:
                me.reply(actor)
        if push % snapshot_every == 0 or push == cfg.steps // cfg.push_every - 1:
            snapshots.append((me.size, me.version, parameters_to_vector(me.net.parameters()).detach().clone()))
    for work in me._sends:
        work.wait()
    return LearnerResult(parameters_to_vector(me.net.parameters()).detach().clone(), me.version, arrivals,
                         staleness, snapshots, me.losses, me.counter)


# --------------------------------------------------------------------------- #
# A whole run
# --------------------------------------------------------------------------- #
@dataclass
class ActorLearnerRun:
    """The learner's result and every actor's trace."""

    config: ActorLearnerConfig
    learner: LearnerResult
    actors: list[ActorTrace]

    @property
    def params(self) -> torch.Tensor:
        return self.learner.params

    def staleness(self) -> list[int]:
        """Every transition's staleness, in the order the transitions reached the replay."""
        return [s for push in self.learner.staleness for s in push]

    def returns(self) -> list[tuple[int, float]]:
        """Finished episodes as (environment steps taken by all actors by then, return), in step order."""
        a = self.config.num_actors
        return sorted((a * step, ret) for trace in self.actors for step, ret, _ in trace.episodes)

    def link_bytes(self, phases: tuple[str, ...] = ("experience", "params")) -> dict[tuple[int, int], int]:
        """Bytes sent over each link ``(src, dst)`` in ``phases``, from the senders' counters."""
        links: dict[tuple[int, int], int] = {}
        for counter in [self.learner.counter] + [t.counter for t in self.actors]:
            for m in counter.messages:
                if m.phase in phases:
                    links[m.src, m.dst] = links.get((m.src, m.dst), 0) + m.nbytes
        return links


def _rank(config: ActorLearnerConfig) -> LearnerResult | ActorTrace:
    if dist.get_world_size() != config.world_size:
        raise ValueError(f"{config.num_actors} actors need world_size {config.world_size}, got {dist.get_world_size()}.")
    return run_learner(config) if dist.get_rank() == 0 else run_actor(config)


def act_and_learn(config: ActorLearnerConfig, timeout: float = 120.0) -> ActorLearnerRun:
    """Launch the learner (rank 0) and ``config.num_actors`` actors; gather what they recorded."""
    results = launch(_rank, config.world_size, config, timeout=timeout)
    return ActorLearnerRun(config, results[0], results[1:])


def greedy_return(config: ActorLearnerConfig, params: torch.Tensor, episodes: int = 5, seed: int = 10**6) -> float:
    """Mean return of the greedy policy with ``params`` over ``episodes`` fresh cart-poles (never a training seed)."""
    net = config.q_network()
    vector_to_parameters(params, net.parameters())
    return play_greedy(net, episodes, seed)
