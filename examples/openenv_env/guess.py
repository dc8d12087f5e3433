"""A small OpenEnv environment written here: guess the hidden number, told "higher" or "lower".

    --custom-generate-function-path slime.rollout.environments.openenv_env.generate
    --env-id examples/openenv_env/guess.py:GuessEnvironment --env-args '{"max_value": 9}' --env-max-turns 3
    [--env-server]    # serve it with OpenEnv's own app on 127.0.0.1 instead of calling it in-process

It is an ordinary OpenEnv environment (`openenv-core`): an `Environment[GuessAction, GuessObservation,
State]` with `reset(seed)` and `step(action)`, typed Action/Observation models, the reward on the
observation. `reset` draws the hidden number from the seed; each step reads the first number of the
model's reply: reward 1.0 and done when it is the hidden number, else "higher"/"lower" (reward 0),
done after `max_guesses` guesses. As a server: `uvicorn` on `create_app(GuessEnvironment, GuessAction,
GuessObservation)` (`python examples/openenv_env/guess.py --port 8000` serves it on 127.0.0.1).
"""

from __future__ import annotations

import random
import re
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

_NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    message: str = Field(..., description="the model's reply; its first number is the guess")


class GuessObservation(Observation):
    prompt: str = Field(default="", description="what the environment says to the model")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every session (episode) has its own instance

    def __init__(self, max_value: int = 9, max_guesses: int = 3):
        super().__init__()
        self.max_value, self.max_guesses = max_value, max_guesses
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(0, self.max_value)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(prompt=f"guess a number from 0 to {self.max_value} . reply with the number .",
                                done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        m = _NUMBER.search(action.message)
        guess = int(m.group(0)) if m else None
        if guess == self.target:
            return GuessObservation(prompt="yes", done=True, reward=1.0, metadata={"guess": guess})
        hint = "no number" if guess is None else ("higher" if guess < self.target else "lower")
        return GuessObservation(prompt=f"{hint} . guess again .", done=self._state.step_count >= self.max_guesses,
                                reward=0.0, metadata={"guess": guess})

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":
    import argparse

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    p = argparse.ArgumentParser(description="serve GuessEnvironment on 127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    uvicorn.run(create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess"), host="127.0.0.1",
                port=p.parse_args().port)
