-- run once by the postgres image on an empty data volume: one database each for Prefect and MLflow
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
