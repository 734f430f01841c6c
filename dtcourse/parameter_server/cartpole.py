"""Cart-pole: the small control task that the actor-learner section trains on, written out here.

A pole is hinged on a cart that runs on a track. Every 0.02 s the agent pushes the cart left or right
with 10 N; it earns 1 for every step the pole stays up, and the episode ends when the pole leans past
12 degrees or the cart leaves the track (2.4 m from the centre). This is the task and the physics of
Barto, Sutton & Anderson ("Neuronlike adaptive elements that can solve difficult learning control
problems", IEEE Trans. SMC 13(5), 1983), without their friction terms and with one Euler step per
tick, the form OpenAI Gym made standard (Brockman et al. 2016, arXiv:1606.01540). An episode is cut
off after ``max_steps`` = 200, as in Gym's CartPole-v0, so a perfect return is 200.

Why the course writes it instead of depending on ``gymnasium``: it is thirty lines of physics that a
student can read next to the equations; it adds no package (and no version of a changing ``step``
API) to the course; and it runs in the forked ranks of ``dtcourse.launch`` with nothing to set up.
Plain Python floats are used for the state because one step is a handful of scalar operations,
which Python does faster than torch or numpy would on 4-element arrays.

    env = CartPole(seed=0)
    state = env.reset()
    state, reward, terminal, truncated = env.step(1)      # push right
    play_greedy(q_network, episodes=5)                    # mean return of argmax_a Q(s, a)
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn

GRAVITY, CART_MASS, POLE_MASS = 9.8, 1.0, 0.1      # m/s^2, kg, kg
HALF_LENGTH, FORCE, TAU = 0.5, 10.0, 0.02          # m (pivot to the pole's centre), N, s per step
ANGLE_LIMIT, POSITION_LIMIT = 12 * math.pi / 180, 2.4


class CartPole:
    """State ``(x, x_dot, theta, theta_dot)``; actions 0 (push left) and 1 (push right)."""

    observation_size, num_actions = 4, 2

    def __init__(self, seed: int = 0, max_steps: int = 200):
        self.rng = random.Random(seed)
        self.max_steps = max_steps
        self.state = (0.0, 0.0, 0.0, 0.0)
        self.steps = 0

    def reset(self) -> tuple[float, float, float, float]:
        """Start near upright and at rest: each variable uniform in [-0.05, 0.05]."""
        self.state = tuple(self.rng.uniform(-0.05, 0.05) for _ in range(4))
        self.steps = 0
        return self.state

    def step(self, action: int) -> tuple[tuple[float, float, float, float], float, bool, bool]:
        """Push, advance 0.02 s; return ``(state, reward, terminal, truncated)``.

        ``terminal``: the pole fell or the cart left the track (the value of what follows is 0).
        ``truncated``: the episode hit ``max_steps`` with the pole still up (not a failure).
        """
        x, x_dot, theta, theta_dot = self.state
        force = FORCE if action == 1 else -FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        total, pole_moment = CART_MASS + POLE_MASS, POLE_MASS * HALF_LENGTH
        temp = (force + pole_moment * theta_dot ** 2 * sin) / total
        theta_acc = (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4 / 3 - POLE_MASS * cos ** 2 / total))
        x_acc = temp - pole_moment * theta_acc * cos / total
        self.state = (x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc)
        self.steps += 1
        terminal = abs(self.state[0]) > POSITION_LIMIT or abs(self.state[2]) > ANGLE_LIMIT
        return self.state, 1.0, terminal, not terminal and self.steps >= self.max_steps


def play_greedy(net: nn.Module, episodes: int = 5, seed: int = 10**6) -> float:
    """Mean return of the policy argmax_a net(s)[a] over ``episodes`` cart-poles seeded ``seed``, ``seed + 1``, ...,
    played side by side: one forward pass per step for all the episodes still running."""
    envs = [CartPole(seed=seed + e) for e in range(episodes)]
    states, total, playing = [env.reset() for env in envs], 0.0, list(range(episodes))
    while playing:
        with torch.no_grad():
            actions = net(torch.tensor([states[e] for e in playing])).argmax(1).tolist()   # (E, 4) -> (E,)
        still = []
        for e, action in zip(playing, actions):
            states[e], reward, terminal, truncated = envs[e].step(action)
            total += reward
            if not (terminal or truncated):
                still.append(e)
        playing = still
    return total / episodes
