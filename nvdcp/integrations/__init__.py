"""Integrations of nvdcp with training frameworks, each imported on demand.

``nvdcp.integrations.torchtitan``: a torchtitan checkpoint manager that saves and loads through
nvdcp (needs ``pip install 'nvdcp[torchtitan]'``). Nothing here is imported by ``import nvdcp``.
"""
