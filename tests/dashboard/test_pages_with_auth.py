"""The pages on a stack with API keys: they ask for the admin key, refuse a tenant key with the server's
reason, keep the key in this tab's sessionStorage only (no cookie, no localStorage, not in a new tab), and
with it show the status and manage adapters."""
from __future__ import annotations

from shared.make_adapters import make_adapters
from tests.dashboard.conftest import ADMIN, TENANT


def enter_key(page, key: str) -> None:
    page.fill("#key-input", key)
    page.click("#key-save")


def test_dashboard_asks_for_the_admin_key_and_keeps_it_in_the_tab_only(secured_stack, page, browser):
    page.goto(f"{secured_stack.url}/dashboard")
    page.wait_for_selector("#key-panel:not(.hidden)")
    assert "API keys on" in page.locator("#key-message").inner_text()
    assert page.locator("#total-requests").get_attribute("data-value") is None  # nothing shown without a key

    enter_key(page, TENANT)
    page.wait_for_selector("#key-panel:not(.hidden)")
    assert "not an admin key" in page.locator("#key-message").inner_text()

    enter_key(page, ADMIN)
    page.wait_for_selector("#total-requests[data-value]")
    page.wait_for_selector("#workers tr[data-worker='worker-0']")
    assert page.locator("#key-panel").is_hidden() and page.locator("#banner").is_hidden()
    assert page.locator("#key-button").inner_text() == "Admin key ✓"
    assert page.evaluate("localStorage.length") == 0 and page.context.cookies() == []

    # The next page of this tab has it; a new tab does not.
    page.click("nav a[href='/dashboard/adapters']")
    page.locator("#adapters tbody tr[data-name='demo-000']").wait_for()
    other = page.context.new_page()
    other.goto(f"{secured_stack.url}/dashboard")
    other.wait_for_selector("#key-panel:not(.hidden)")
    other.close()

    # Forgetting it locks the pages again.
    page.click("#key-button")
    page.click("#key-forget")
    page.wait_for_selector("#banner.error")
    assert "admin key" in page.locator("#banner").inner_text()


def test_upload_and_delete_with_the_admin_key(secured_stack, page, tmp_path):
    folder = make_adapters(tmp_path, secured_stack.data_dir / "model", 1, ranks=[8], seed=5151, prefix="keyed")[0]
    page.goto(f"{secured_stack.url}/dashboard/adapters")
    page.wait_for_selector("#key-panel:not(.hidden)")
    enter_key(page, ADMIN)
    page.locator("#adapters tbody tr[data-name='demo-000']").wait_for()
    page.set_input_files("#upload-folder", str(folder))
    page.click("#upload-button")
    page.wait_for_selector("#upload-result.ok")
    with secured_stack.client(headers={"Authorization": f"Bearer {TENANT}"}) as c:
        r = c.post("/v1/completions", json={"model": "keyed-000", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text  # shared adapters serve every tenant
    page.locator("#adapters tbody tr[data-name='keyed-000']").click()
    page.wait_for_selector("#card-body:not(.hidden)")
    page.click("#delete")
    page.click("#delete")
    page.wait_for_selector("#banner.ok")
    with secured_stack.client(headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        assert c.get("/v1/adapters/keyed-000").status_code == 404
