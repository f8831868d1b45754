"""Ridgeline's event-loop side: engine, scheduler, server, offline `LLM`."""

from app.outputs import RequestOutput
from app.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it lazily so `app.scheduler` stays light.
    if name == "LLM":
        from app.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
