"""meshplan.cost_model"""
