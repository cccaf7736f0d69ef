"""Adapter management over HTTP, forwarded to the adapter_store, plus /v1/models.

POST /v1/adapters (multipart upload, or JSON {name, path}), GET /v1/adapters[/{name}],
DELETE /v1/adapters/{name}, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter. The store
validates and decides; the gateway checks who may ask, shapes the HTTP answer and caps the body size.
"""
from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from services.gateway.auth import Caller, require_admin
from services.gateway.errors import ApiError, bad_request
from services.gateway.inference import read_body
from services.gateway.state import LOOKUP_TIMEOUT_S, GatewayState
from services.gateway.validation import parse_json
from shared.wire import (
    AdapterCard, AdapterList, AdapterRegistered, DeleteAdapter, GetAdapter, ListAdapters, RegisterAdapter,
)

FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers on top of the two files
FORM_FIELDS = {"name", "tenant", "adapter_config", "adapter_model"}


def card_json(card: AdapterCard, residency: str) -> dict:
    return {"id": card.id, "object": "adapter", "name": card.name, "tenant": card.tenant, "rank": card.rank,
            "target_modules": list(card.target_modules), "sha256": card.sha256, "bytes": card.bytes,
            "created": int(card.created), "status": card.status, "residency": residency}


def _admin(request: Request) -> tuple[GatewayState, Caller]:
    state: GatewayState = request.app.state.gateway
    caller = state.keys.caller(request.headers.get("authorization"))
    require_admin(caller)
    return state, caller


def _tenant_param(request: Request) -> str:
    tenant = request.query_params.get("tenant", "")
    return tenant


async def _counted(request: Request, op: str, handler) -> Response:
    state: GatewayState = request.app.state.gateway
    try:
        response = await handler()
    except ApiError as e:
        response = e.response()
    state.metrics.adapter_ops.labels(op=op, status=str(response.status_code)).inc()
    return response


# ---- registration ----------------------------------------------------------------------------------

async def register(request: Request) -> Response:
    return await _counted(request, "register", lambda: _register(request))


async def _register(request: Request) -> Response:
    state, _ = _admin(request)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        msg = await _from_form(request, state)
    else:
        body = parse_json(await read_body(request, state.config.max_body_bytes))
        unknown = sorted(set(body) - {"name", "path", "tenant"})
        if unknown:
            raise bad_request(f"unrecognized field(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
        msg = RegisterAdapter(name=_str_field(body, "name"), tenant=_str_field(body, "tenant", ""),
                              path=_str_field(body, "path"))
    reply = await state.store.call(msg)
    return _registered(state, reply)


def _registered(state: GatewayState, reply) -> Response:
    if not isinstance(reply, AdapterRegistered):
        raise ApiError(500, f"unexpected reply from the adapter store: {type(reply).__name__}", None, "internal_error")
    state.forget_adapter(reply.card.name)
    state.log.info("adapter registered" if reply.created else "adapter already registered",
                   adapter=reply.card.id, tenant=reply.card.tenant)
    return JSONResponse(card_json(reply.card, state.residency(reply.card)), status_code=201 if reply.created else 200)


def _str_field(body: dict, name: str, default: str | None = None) -> str:
    value = body.get(name, default)
    if value is None:
        raise bad_request(f"{name} is required", name, "missing_required_parameter")
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string", name, "invalid_type")
    return value


async def _from_form(request: Request, state: GatewayState) -> RegisterAdapter:
    await read_body(request, state.config.max_upload_bytes + FORM_OVERHEAD)
    try:
        form = await request.form(max_files=2, max_fields=4)
    except HTTPException as e:
        raise bad_request(f"malformed multipart body: {e.detail}", None, "invalid_multipart") from None
    try:
        unknown = sorted(set(form.keys()) - FORM_FIELDS)
        if unknown:
            raise bad_request(f"unrecognized form field(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("form field name is required", "name", "missing_required_parameter")
        tenant = form.get("tenant", "")
        if not isinstance(tenant, str):
            raise bad_request("form field tenant must be text", "tenant", "invalid_type")
        files = {}
        for field_name, file_name in (("adapter_config", "adapter_config.json"), ("adapter_model", "adapter_model.safetensors")):
            upload = form.get(field_name)
            if not isinstance(upload, UploadFile):
                raise bad_request(f"file {field_name} ({file_name}) is required", field_name, "missing_file")
            files[field_name] = await upload.read()
        return RegisterAdapter(name=name, tenant=tenant, config_json=files["adapter_config"],
                               model_safetensors=files["adapter_model"])
    finally:
        await form.close()


# ---- listing, lookup, deletion ---------------------------------------------------------------------

async def list_adapters(request: Request) -> Response:
    async def handler():
        state, _ = _admin(request)
        listing = await state.store.call(ListAdapters(all_tenants=True), timeout_s=LOOKUP_TIMEOUT_S)
        assert isinstance(listing, AdapterList)
        gpu = state.gpu_resident()
        return JSONResponse({"object": "list", "data": [card_json(c, state.residency(c, gpu)) for c in listing.cards]})
    return await _counted(request, "list", handler)


async def get_adapter(request: Request) -> Response:
    async def handler():
        state, _ = _admin(request)
        card = await state.store.call(GetAdapter(name=request.path_params["name"], tenant=_tenant_param(request)),
                                      timeout_s=LOOKUP_TIMEOUT_S)
        return JSONResponse(card_json(card, state.residency(card)))
    return await _counted(request, "get", handler)


async def delete_adapter(request: Request) -> Response:
    async def handler():
        state, _ = _admin(request)
        name, tenant = request.path_params["name"], _tenant_param(request)
        await state.store.call(DeleteAdapter(name=name, tenant=tenant))
        state.forget_adapter(name)
        state.log.info("adapter deleted", adapter_name=name, tenant=tenant)
        return Response(status_code=204)
    return await _counted(request, "delete", handler)


# ---- vLLM-compatible aliases -----------------------------------------------------------------------

async def load_lora_adapter(request: Request) -> Response:
    async def handler():
        state, _ = _admin(request)
        body = parse_json(await read_body(request, state.config.max_body_bytes))
        unknown = sorted(set(body) - {"lora_name", "lora_path", "load_inplace"})
        if unknown:
            raise bad_request(f"unrecognized field(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
        name, path = _str_field(body, "lora_name"), _str_field(body, "lora_path")
        reply = await state.store.call(RegisterAdapter(name=name, path=path))
        _registered(state, reply)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
    return await _counted(request, "register", handler)


async def unload_lora_adapter(request: Request) -> Response:
    async def handler():
        state, _ = _admin(request)
        body = parse_json(await read_body(request, state.config.max_body_bytes))
        unknown = sorted(set(body) - {"lora_name", "lora_int_id"})
        if unknown:
            raise bad_request(f"unrecognized field(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
        name = _str_field(body, "lora_name")
        await state.store.call(DeleteAdapter(name=name))
        state.forget_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
    return await _counted(request, "delete", handler)


# ---- models ----------------------------------------------------------------------------------------

async def list_models(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    try:
        caller = state.keys.caller(request.headers.get("authorization"))
        listing = await state.store.call(ListAdapters(tenant=caller.tenant), timeout_s=LOOKUP_TIMEOUT_S)
    except ApiError as e:
        return e.response()
    gpu = state.gpu_resident()
    data = [{"id": state.base_name, "object": "model", "created": 0, "owned_by": "loraplex", "root": state.base_name,
             "parent": None, "max_model_len": state.max_model_len, "residency": "gpu"}]
    for card in listing.cards:
        if card.status != "ready":
            continue
        data.append({"id": card.name, "object": "model", "created": int(card.created),
                     "owned_by": card.tenant or "loraplex", "root": state.base_name, "parent": state.base_name,
                     "rank": card.rank, "target_modules": list(card.target_modules),
                     "residency": state.residency(card, gpu)})
    return JSONResponse({"object": "list", "data": data})
