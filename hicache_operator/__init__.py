"""HiCacheDeployment operator: spec models, validation, sizing, rendering and kopf handlers."""
