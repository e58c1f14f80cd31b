"""The shop: orders, inventory, payments and shipping as four eventflow services.

See README.md in this folder. Each service is its own module with its own ``App``; they
share only ``events.py`` (the messages), ``settings.py`` (configuration from the
environment) and ``catalog.py`` (what is for sale).
"""
