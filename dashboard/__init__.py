"""Streamlit dashboard (reads run directories and MLflow; never trains). Pages arrive with the tracking issue."""
