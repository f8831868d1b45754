"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's bodies and answers.

Operator routes: they read files on the server's disk and change what every client is
served. vLLM gates them behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; here they need
`--admin-api-key` to be set and sent (without it they are refused outright, a 403), and
the adapter's directory must lie within `--lora-allowed-dirs` (`app/engine/loras.py`).
A bad adapter is a 400 and the server goes on serving; an unknown name to unload, a 404.
Unloading fails the adapter's waiting and running requests with an error (docs/lora.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from app.server.auth import is_admin
from app.server.errors import APIError, parse
from app.server.state import engine


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body may carry it; names are what we key by


def _admin_only(request: Request) -> None:
    if not is_admin(request):
        raise APIError(403, f"{request.url.path} loads files on the server: it needs "
                       "--admin-api-key set and sent", None, "permission_error",
                       "admin_key_required")


async def load_lora_adapter(request: Request, body: dict) -> PlainTextResponse:
    _admin_only(request)
    req = parse(LoadLoRARequest, body)
    await engine(request).load_lora(req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request, body: dict) -> PlainTextResponse:
    _admin_only(request)
    req = parse(UnloadLoRARequest, body)
    await engine(request).unload_lora(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
