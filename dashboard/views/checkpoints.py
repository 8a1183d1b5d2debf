"""Checkpoints page: a run's checkpoints with their eval scores, and an evaluation started through Prefect."""

import streamlit as st

from dashboard import actions, loaders
from dashboard.widgets import empty_state, pick_run

COLUMNS = {
    "eval pass@1": st.column_config.NumberColumn(format="%.3f", help="held-out eval at the step it was saved"),
    "re-eval pass@1": st.column_config.NumberColumn(format="%.3f", help="eval.json from a later evaluation"),
}


def evaluate(checkpoint: dict) -> None:
    """The Prefect trigger when a server is configured; the CLI command always."""
    api = actions.prefect_api_url()
    if not api:
        st.warning(
            "No Prefect server is configured (PREFECT_API_URL is not set), so an evaluation cannot be started "
            "from here. Run it from a shell instead:"
        )
    elif st.button(f"Evaluate {checkpoint['checkpoint']} through Prefect", type="primary"):
        try:
            started = actions.start_evaluation(api, checkpoint["path"])
        except actions.TriggerError as e:
            st.error(str(e))
        else:
            st.success(
                f"flow run `{started.flow_run_name}` ({started.flow_run_id}) of `{actions.DEPLOYMENT}` scheduled; "
                "its eval.json shows up in the table when it finishes"
            )
            st.link_button("Open in Prefect", started.url)
    st.code(f"forgeweave eval {checkpoint['path']}", language="bash")
    if not api:
        st.caption(
            "To evaluate from this page, start a Prefect server and serve the deployments, then restart the dashboard:"
        )
        st.code(
            "forgeweave server\nexport PREFECT_API_URL=http://127.0.0.1:4200/api\nforgeweave serve\nforgeweave dashboard",
            language="bash",
        )


def render() -> None:
    st.title("Checkpoints")
    names = loaders.run_names()
    if not names:
        empty_state()
        return
    name = pick_run(names)
    ckpts = loaders.checkpoints(name)
    if not ckpts:
        st.info("no checkpoint yet: one is saved every `checkpoint.every` steps and at the last step")
        return
    st.dataframe(ckpts, hide_index=True, column_config=COLUMNS)
    labels = [c["checkpoint"] for c in ckpts]
    chosen = st.selectbox("Checkpoint", labels, index=len(labels) - 1)
    evaluate(ckpts[labels.index(chosen)])


render()
