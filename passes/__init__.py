"""meshplan.passes"""
