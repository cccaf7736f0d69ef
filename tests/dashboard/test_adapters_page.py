"""The adapters page in headless Chromium against a real stack: search the registry, read a card, upload an
adapter from the browser and use it through the API, see a refused upload's reason, delete from the page."""
from __future__ import annotations

import time

from playwright.sync_api import expect

from shared.make_adapters import make_adapters
from tests.dashboard.conftest import complete


def row(page, name: str):
    return page.locator(f"#adapters tbody tr[data-name='{name}']")


def test_upload_from_the_page_then_use_it_through_the_api_then_delete_it(stack, page, tmp_path):
    folder = make_adapters(tmp_path, stack.data_dir / "model", 1, ranks=[12], seed=4242, prefix="page-upload")[0]
    page.goto(f"{stack.url}/dashboard/adapters")
    row(page, "demo-000").wait_for()

    page.set_input_files("#upload-config", str(folder / "adapter_config.json"))
    page.set_input_files("#upload-model", str(folder / "adapter_model.safetensors"))
    page.fill("#upload-name", "from-the-page")
    page.click("#upload-button")
    page.wait_for_selector("#upload-result.ok")
    assert "Added from-the-page (rank 12" in page.locator("#upload-result").inner_text()
    row(page, "from-the-page").wait_for()

    with stack.client() as c:
        card = c.get("/v1/adapters/from-the-page").json()
        used = complete(c, "from-the-page", 1, max_tokens=5)
        assert used.status_code == 200 and used.json()["usage"]["completion_tokens"] == 5
        base = complete(c, "model", 1, max_tokens=5)
        assert used.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]  # the adapter changed the output

    # The card the page shows is the registry's, and says where the adapter is held now that it served (the
    # gateway learns of the copy into the GPU pool with the worker's next status). On a loaded machine the
    # worker may have been restarted meanwhile (an empty pool): serve the adapter again and look again.
    shown = ""
    deadline = time.monotonic() + 30
    while shown != "gpu" and time.monotonic() < deadline:
        with stack.client() as c:
            waited = time.monotonic() + 10
            while c.get("/v1/adapters/from-the-page").json()["residency"] != "gpu" and time.monotonic() < waited:
                time.sleep(0.1)
        page.click("#refresh")
        row(page, "from-the-page").click()
        page.wait_for_selector("#card-body:not(.hidden)")
        shown = page.locator("#card-residency .badge").inner_text()
        if shown != "gpu":
            with stack.client() as c:
                assert complete(c, "from-the-page", 1, max_tokens=2).status_code == 200
    assert shown == "gpu"
    assert page.locator("#card-sha256").inner_text() == card["sha256"]
    assert page.locator("#card-id").inner_text() == card["id"]
    assert page.locator("#card-rank").inner_text() == "12"
    assert page.locator("#card-targets").inner_text() == ", ".join(card["target_modules"])
    assert f"({card['bytes']:,} bytes)" in page.locator("#card-size").inner_text()

    # Delete asks once more, then the adapter is gone for the API too.
    page.click("#delete")
    assert page.locator("#delete").inner_text() == "Confirm delete"
    page.click("#delete")
    page.wait_for_selector("#banner.ok")
    assert "Deleted from-the-page" in page.locator("#banner").inner_text()
    expect(row(page, "from-the-page")).to_have_count(0)
    with stack.client() as c:
        assert c.get("/v1/adapters/from-the-page").status_code == 404
        assert complete(c, "from-the-page", 1).status_code == 404


def test_a_folder_picked_in_the_page_fills_the_name_and_uploads(stack, page, tmp_path):
    folder = make_adapters(tmp_path, stack.data_dir / "model", 1, ranks=[4], seed=4343, prefix="Picked_Folder")[0]
    page.goto(f"{stack.url}/dashboard/adapters")
    page.set_input_files("#upload-folder", str(folder))
    assert "both files found" in page.locator("#upload-note").inner_text()
    assert page.input_value("#upload-name") == "picked_folder-000"
    page.click("#upload-button")
    page.wait_for_selector("#upload-result.ok")
    row(page, "picked_folder-000").wait_for()
    with stack.client() as c:
        assert complete(c, "picked_folder-000", 2, max_tokens=3).status_code == 200


def test_a_refused_upload_shows_the_servers_reason_and_stores_nothing(stack, page, tmp_path):
    folder = make_adapters(tmp_path, stack.data_dir / "model", 1, ranks=[4], seed=4444, prefix="broken")[0]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes((folder / "adapter_model.safetensors").read_bytes()[:200])
    page.goto(f"{stack.url}/dashboard/adapters")
    page.set_input_files("#upload-config", str(folder / "adapter_config.json"))
    page.set_input_files("#upload-model", str(truncated))
    page.fill("#upload-name", "broken-upload")
    page.click("#upload-button")
    page.wait_for_selector("#upload-result.error")
    text = page.locator("#upload-result").inner_text()
    assert "Upload refused (400)" in text and "safetensors" in text
    # A name the server would refuse is caught before anything is sent.
    page.fill("#upload-name", "Not A Name")
    page.set_input_files("#upload-model", str(folder / "adapter_model.safetensors"))
    page.click("#upload-button")
    assert "The name must be" in page.locator("#upload-result").inner_text()
    with stack.client() as c:
        assert c.get("/v1/adapters/broken-upload").status_code == 404


def test_search_narrows_the_registry(stack, page, tmp_path):
    folders = make_adapters(tmp_path, stack.data_dir / "model", 3, ranks=[2], seed=4545, prefix="searchable",
                            targets=["q_proj", "v_proj"])
    with stack.client() as c:
        for f in folders:
            files = {"adapter_config": ("adapter_config.json", (f / "adapter_config.json").read_bytes()),
                     "adapter_model": ("adapter_model.safetensors", (f / "adapter_model.safetensors").read_bytes())}
            assert c.post("/v1/adapters", data={"name": f.name}, files=files).status_code == 201
    page.goto(f"{stack.url}/dashboard/adapters")
    row(page, "searchable-001").wait_for()
    page.fill("#search", "searchable")
    expect(page.locator("#adapters tbody tr[data-name]")).to_have_count(3)
    assert page.locator("#match-count").inner_text().startswith("3 of ")
    page.fill("#search", "v_proj searchable-002")  # every word must match: a target module and a name
    expect(page.locator("#adapters tbody tr[data-name]")).to_have_count(1)
    assert row(page, "searchable-002").count() == 1
    page.fill("#search", "nothing-is-called-this")
    expect(page.locator("#adapters tbody")).to_have_text("no adapter matches")
