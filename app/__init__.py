"""Ridgeline's event-loop side: engine, server, offline `LLM`, client, benchmarks.

`from app import LLM, SamplingParams, RequestOutput` is the offline API. LLM pulls in
torch and the model, so it is imported lazily: the light client install
(`app.client`, `ridgeline bench serve`) never loads torch.
"""

from app.engine.outputs import RequestOutput
from app.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from app.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
