"""meshplan.runtime"""
